//! One delivery as the consumer describes it to `begin`: its key and fingerprint, and the
//! optional facts the engine can act on (production time, entity version, correlation id).

use crate::format::fingerprint::Fingerprint;

/// A delivery to claim. Only the key and the fingerprint are required.
///
/// ```
/// use idemdb::{Fingerprint, Message};
/// let body = b"order 42: 3 apples";
/// let message = Message::new(b"order-42", Fingerprint::of(body))
///     .produced_at_ms(1_767_225_600_000) // for the admission floor
///     .version(b"customer-7", 12)          // for the ordering guard
///     .correlation_id("req-9f2c");         // for logs
/// # let _ = message;
/// ```
#[derive(Clone, Copy, Debug)]
#[must_use]
pub struct Message<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) fingerprint: Fingerprint,
    pub(crate) produced_at_ms: Option<u64>,
    pub(crate) version: Option<(&'a [u8], u64)>,
    pub(crate) correlation_id: Option<&'a str>,
}

impl<'a> Message<'a> {
    /// A delivery with its business key (a stable identifier, never a delivery-attempt id)
    /// and the fingerprint of its immutable content.
    pub fn new(key: &'a (impl AsRef<[u8]> + ?Sized), fingerprint: Fingerprint) -> Message<'a> {
        Message {
            key: key.as_ref(),
            fingerprint,
            produced_at_ms: None,
            version: None,
            correlation_id: None,
        }
    }

    /// When the producer created the message (ms since the Unix epoch). With the engine's
    /// admission floor on, a message older than the retention is [`crate::Outcome::TooLate`].
    pub fn produced_at_ms(mut self, produced_at_ms: u64) -> Message<'a> {
        self.produced_at_ms = Some(produced_at_ms);
        self
    }

    /// The ordering guard: the message carries `version` of `entity`. It is claimed only
    /// if `version` is newer than the entity's highest applied version, which the commit then
    /// records in the same batch; otherwise `begin` reports [`crate::Outcome::Stale`]. Entity
    /// keys follow the message-key limits.
    pub fn version(mut self, entity: &'a (impl AsRef<[u8]> + ?Sized), version: u64) -> Message<'a> {
        self.version = Some((entity.as_ref(), version));
        self
    }

    /// The caller's correlation id, carried into idemdb's log events.
    pub fn correlation_id(mut self, correlation_id: &'a str) -> Message<'a> {
        self.correlation_id = Some(correlation_id);
        self
    }

    /// The message key, as given to [`Message::new`]. (The getters let a backend outside this
    /// crate, idemdb-postgres, read a message the way the engine does.)
    ///
    /// ```
    /// use idemdb::{Fingerprint, Message};
    /// let message = Message::new(b"order-42", Fingerprint::of(b"body")).version(b"customer-7", 12);
    /// assert_eq!(message.key(), b"order-42");
    /// assert_eq!(message.fingerprint(), Fingerprint::of(b"body"));
    /// assert_eq!(message.entity_version(), Some((&b"customer-7"[..], 12)));
    /// assert_eq!(message.production_time_ms(), None);
    /// ```
    #[must_use]
    pub fn key(&self) -> &'a [u8] {
        self.key
    }

    /// The fingerprint of the message's content.
    #[must_use]
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// When the producer created the message (ms since the Unix epoch), if given with
    /// [`Message::produced_at_ms`].
    #[must_use]
    pub fn production_time_ms(&self) -> Option<u64> {
        self.produced_at_ms
    }

    /// The ordering guard's (entity key, version), if given with [`Message::version`].
    #[must_use]
    pub fn entity_version(&self) -> Option<(&'a [u8], u64)> {
        self.version
    }

    /// The correlation id, if given with [`Message::correlation_id`].
    #[must_use]
    pub fn correlation(&self) -> Option<&'a str> {
        self.correlation_id
    }
}
