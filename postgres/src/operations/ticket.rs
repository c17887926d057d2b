//! Lease tickets: what an external holder keeps, in its own storage, to find its claim again
//! after a restart, on this process or another.
//!
//! A ticket names the claim (consumer, key, epoch and the holder's fencing token) and nothing
//! else: [`PgConsumer::resume`] reads the rest (fingerprint, holder, lease) from the key's
//! in-progress record, and refuses with `LeaseLost` a ticket whose holder no longer holds the
//! key. Its bytes are versioned, so a ticket written by this release is read by later ones.

use bytes::Bytes;
use idemdb::format::{Record, RecordState, encode_key};
use tokio_postgres::Client;

use crate::error::{Error, Result};
use crate::operations::external::PgExternalClaim;
use crate::storage::store::PgConsumer;

/// The first byte of a ticket's bytes: the layout's version.
const TICKET_VERSION: u8 = 1;

/// What an external holder keeps to resume its claim ([`PgExternalClaim::ticket`],
/// [`PgConsumer::resume`]). Store it as [`PgLeaseTicket::to_bytes`]; read it back with
/// [`PgLeaseTicket::from_bytes`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgLeaseTicket {
    pub(crate) consumer: Bytes,
    pub(crate) key: Vec<u8>,
    pub(crate) epoch: u64,
    pub(crate) token: u64,
}

impl PgLeaseTicket {
    /// The message key of the claim.
    #[must_use]
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The epoch the ticket's holder was given.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The ticket as bytes: a version byte, the consumer id and the key (each after its
    /// length, as a big-endian u16), then the epoch and the token (big-endian u64s).
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + 2 + self.consumer.len() + 2 + self.key.len() + 16);
        out.push(TICKET_VERSION);
        for part in [self.consumer.as_ref(), self.key.as_slice()] {
            // Both lengths are within idemdb's limits (checked when the claim was made, and
            // again by `from_bytes`), far below u16::MAX.
            out.extend_from_slice(&u16::try_from(part.len()).unwrap_or(u16::MAX).to_be_bytes());
            out.extend_from_slice(part);
        }
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.token.to_be_bytes());
        out
    }

    /// Reads a ticket written by [`PgLeaseTicket::to_bytes`].
    ///
    /// # Errors
    /// [`Error::MalformedTicket`] for bytes that are not a ticket (another version, cut short,
    /// trailing bytes, an epoch of 0); [`Error::Idemdb`] for a consumer id or key outside
    /// idemdb's limits.
    pub fn from_bytes(bytes: &[u8]) -> Result<PgLeaseTicket> {
        let malformed = |detail: &str| Error::MalformedTicket {
            detail: detail.to_owned(),
        };
        let (&version, rest) = bytes.split_first().ok_or_else(|| malformed("empty"))?;
        if version != TICKET_VERSION {
            return Err(malformed(&format!("unknown version {version}")));
        }
        let mut reader = Reader(rest);
        let consumer = reader.part().ok_or_else(|| malformed("cut short"))?;
        let key = reader.part().ok_or_else(|| malformed("cut short"))?;
        let epoch = reader.number().ok_or_else(|| malformed("cut short"))?;
        let token = reader.number().ok_or_else(|| malformed("cut short"))?;
        if !reader.0.is_empty() {
            return Err(malformed("trailing bytes"));
        }
        if epoch == 0 {
            return Err(malformed("epoch 0 (epochs start at 1)"));
        }
        encode_key(&consumer, &key)?;
        Ok(PgLeaseTicket {
            consumer: Bytes::from(consumer),
            key,
            epoch,
            token,
        })
    }
}

/// Reads a ticket's fields from the front of its bytes; `None` when they are cut short.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    /// A length-prefixed part.
    fn part(&mut self) -> Option<Vec<u8>> {
        let len = self.take(2)?;
        let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
        Some(self.take(len)?.to_vec())
    }

    fn number(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
}

impl PgConsumer {
    /// Rebuilds an external claim from its ticket, after a restart say: the claim's fingerprint,
    /// holder and lease are read back from the key's in-progress record. Whether the lease is
    /// still live is not looked at (renew it first thing); every later step is fenced as usual.
    ///
    /// # Errors
    /// [`Error::Idemdb`] with `ForeignTicket` for a ticket of another consumer, `LeaseLost`
    /// (with the key's current epoch, 0 for none) when the key is no longer this holder's: taken
    /// over, resolved, completed or released; [`Error::Corrupt`]; [`Error::Postgres`].
    pub async fn resume(&self, client: &Client, ticket: &PgLeaseTicket) -> Result<PgExternalClaim> {
        if ticket.consumer != self.id {
            return Err(Error::Idemdb(idemdb::Error::ForeignTicket));
        }
        let record = self.read(client, &ticket.key).await?;
        let current_epoch = record.as_ref().map_or(0, |record| record.epoch);
        match record {
            Some(record)
                if record.epoch == ticket.epoch
                    && matches!(record.state, RecordState::InProgress { token, .. } if token == ticket.token) =>
            {
                Ok(PgExternalClaim::resumed(self, ticket, record))
            }
            _ => Err(Error::Idemdb(idemdb::Error::LeaseLost { current_epoch })),
        }
    }
}

impl PgExternalClaim {
    /// What to keep to resume this claim after a restart ([`PgConsumer::resume`]).
    #[must_use]
    pub fn ticket(&self) -> PgLeaseTicket {
        PgLeaseTicket {
            consumer: self.consumer.id.clone(),
            key: self.key.clone(),
            epoch: self.epoch,
            token: self.token,
        }
    }

    /// The claim `ticket` names, from its in-progress `record` (checked by the caller to carry
    /// the ticket's epoch and token). The attempt it took over is not known any more.
    pub(crate) fn resumed(
        consumer: &PgConsumer,
        ticket: &PgLeaseTicket,
        record: Record,
    ) -> PgExternalClaim {
        let (since_ms, lease_until_ms, holder) = match record.state {
            RecordState::InProgress {
                since_ms,
                lease_until_ms,
                holder,
                ..
            } => (since_ms, lease_until_ms, holder),
            // Not reached (the caller matched the state); a claim that fails its first fenced
            // step is the safe answer anyway.
            _ => (0, 0, Bytes::new()),
        };
        PgExternalClaim {
            consumer: consumer.clone(),
            key: ticket.key.clone(),
            stored_key: encode_key(&consumer.id, &ticket.key).unwrap_or_default(),
            fingerprint: record.fingerprint,
            epoch: ticket.epoch,
            token: ticket.token,
            since_ms,
            lease_until_ms,
            holder,
            previous: None,
            alive: consumer.metrics.alive(),
        }
    }
}
