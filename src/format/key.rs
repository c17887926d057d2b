//! Composite dedup keys: the injective encoding of (consumer id, message key) into one stored key.
//!
//! Layout (see docs/design.md): `[consumer_len: u8][consumer id bytes][message key bytes]`.
//! The length byte fixes where the consumer id ends, so the split is unique whatever bytes either
//! part contains: two different pairs never encode to the same bytes. All keys of one consumer
//! share the prefix `[consumer_len][consumer id]` and sort together, by message key.

use smallvec::SmallVec;

use crate::format::error::DecodeError;
use crate::format::error::{Limit, Result, check_limit};

/// A stored key as the claim path holds it: up to [`STORED_KEY_INLINE_BYTES`] bytes inline, longer
/// keys on the heap. Every claim keeps its key twice (in the claim and in the latch set), and
/// the instruction profile counted the allocator at about 2,000 instructions per claim; a
/// consumer prefix plus a UUID fits inline, so the common claim allocates neither copy.
pub(crate) type StoredKey = SmallVec<[u8; STORED_KEY_INLINE_BYTES]>;

/// Stored keys up to this length are kept inline: the length byte, a consumer id of up to 11
/// bytes and a 36-character UUID.
pub(crate) const STORED_KEY_INLINE_BYTES: usize = 48;

/// The shortest consumer id, in bytes.
pub const CONSUMER_ID_BYTES_MIN: usize = 1;
/// The longest consumer id, in bytes. It is stored in the key's one-byte length prefix.
pub const CONSUMER_ID_BYTES_MAX: usize = 255;
/// The shortest message key, in bytes.
pub const MESSAGE_KEY_BYTES_MIN: usize = 1;
/// The longest message key, in bytes. Dedup keys are identifiers, not payloads.
pub const MESSAGE_KEY_BYTES_MAX: usize = 1024;

/// Checks a consumer id against its limits.
pub(crate) fn check_consumer_id(consumer_id: &[u8]) -> Result<()> {
    check_limit(
        Limit::ConsumerIdBytes,
        consumer_id.len(),
        CONSUMER_ID_BYTES_MIN,
        CONSUMER_ID_BYTES_MAX,
    )
}

/// Checks a message key against its limits.
pub(crate) fn check_message_key(message_key: &[u8]) -> Result<()> {
    check_limit(
        Limit::MessageKeyBytes,
        message_key.len(),
        MESSAGE_KEY_BYTES_MIN,
        MESSAGE_KEY_BYTES_MAX,
    )
}

/// The column family holding every consumer's dedup records (the table named in export lines).
#[cfg(any(feature = "engine", feature = "transfer"))]
pub(crate) const RECORDS_TABLE: &str = "idemdb.records";

/// The stored-key prefix shared by every key of one consumer: `[len][id]`.
pub(crate) fn consumer_prefix(consumer_id: &[u8]) -> Result<Vec<u8>> {
    check_consumer_id(consumer_id)?;
    let mut prefix = Vec::with_capacity(1 + consumer_id.len());
    // Checked above: the length fits the byte.
    prefix.push(u8::try_from(consumer_id.len()).expect("consumer id length checked"));
    prefix.extend_from_slice(consumer_id);
    Ok(prefix)
}

/// Appends `message_key` to a prefix made by [`consumer_prefix`], as a plain vector (the
/// operator tools and [`encode_key`]; the claim path keeps [`stored_key`]'s inline form).
pub(crate) fn encode_with_prefix(prefix: &[u8], message_key: &[u8]) -> Result<Vec<u8>> {
    Ok(stored_key(prefix, message_key)?.into_vec())
}

/// Appends `message_key` to a prefix made by [`consumer_prefix`], as the claim path keeps it.
pub(crate) fn stored_key(prefix: &[u8], message_key: &[u8]) -> Result<StoredKey> {
    check_message_key(message_key)?;
    // Sized once, then copied into: `extend_from_slice` is SmallVec's insert at the end, two
    // copies each (160 instructions a key against 60).
    let mut key = StoredKey::from_elem(0, prefix.len() + message_key.len());
    let (head, tail) = key.split_at_mut(prefix.len());
    head.copy_from_slice(prefix);
    tail.copy_from_slice(message_key);
    Ok(key)
}

/// Encodes (consumer id, message key) into the stored key.
///
/// # Errors
/// [`crate::Error::LimitExceeded`] when either part is empty or too long.
///
/// ```
/// let key = idemdb::format::encode_key(b"billing", b"order-42")?;
/// assert_eq!(key[0], 7); // length of "billing"
/// assert_eq!(idemdb::format::decode_key(&key)?, (&b"billing"[..], &b"order-42"[..]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn encode_key(consumer_id: &[u8], message_key: &[u8]) -> Result<Vec<u8>> {
    encode_with_prefix(&consumer_prefix(consumer_id)?, message_key)
}

/// Splits a stored key back into (consumer id, message key).
///
/// # Errors
/// [`DecodeError`] when the bytes are not a valid encoding (empty, a length prefix running past
/// the end, or either part outside its limits).
pub fn decode_key(stored_key: &[u8]) -> Result<(&[u8], &[u8]), DecodeError> {
    let (&consumer_len, rest) = stored_key.split_first().ok_or(DecodeError::Truncated {
        needed: 1,
        available: 0,
    })?;
    let consumer_len = usize::from(consumer_len);
    if consumer_len < CONSUMER_ID_BYTES_MIN {
        return Err(DecodeError::BadKey {
            reason: "empty consumer id",
        });
    }
    if rest.len() < consumer_len {
        return Err(DecodeError::Truncated {
            needed: 1 + consumer_len,
            available: stored_key.len(),
        });
    }
    let (consumer_id, message_key) = rest.split_at(consumer_len);
    if message_key.len() < MESSAGE_KEY_BYTES_MIN {
        return Err(DecodeError::BadKey {
            reason: "empty message key",
        });
    }
    if message_key.len() > MESSAGE_KEY_BYTES_MAX {
        return Err(DecodeError::BadKey {
            reason: "message key longer than MESSAGE_KEY_BYTES_MAX",
        });
    }
    Ok((consumer_id, message_key))
}

/// Builds a message key from a CloudEvents event's `source` and `id`: together they
/// identify an event, and either alone may repeat. Layout: `[source_len: u16 BE][source][id]`,
/// injective like the composite key.
///
/// # Errors
/// [`crate::Error::LimitExceeded`] ([`Limit::MessageKeyBytes`]) if either is empty or the key
/// would be longer than [`MESSAGE_KEY_BYTES_MAX`].
///
/// ```
/// let key = idemdb::cloudevents_key("/billing/invoices", "A234-1234-1234")?;
/// assert_eq!(key.len(), 2 + 17 + 14);
/// # Ok::<(), idemdb::Error>(())
/// ```
pub fn cloudevents_key(source: &str, id: &str) -> Result<Vec<u8>> {
    let len = 2 + source.len() + id.len();
    if source.is_empty() || id.is_empty() {
        return Err(crate::format::error::Error::limit(
            Limit::MessageKeyBytes,
            source.len().min(id.len()),
            MESSAGE_KEY_BYTES_MIN,
            MESSAGE_KEY_BYTES_MAX,
        ));
    }
    check_limit(
        Limit::MessageKeyBytes,
        len,
        MESSAGE_KEY_BYTES_MIN,
        MESSAGE_KEY_BYTES_MAX,
    )?;
    let mut key = Vec::with_capacity(len);
    // Bounded by MESSAGE_KEY_BYTES_MAX above, so the length fits in u16.
    key.extend_from_slice(&u16::try_from(source.len()).expect("checked").to_be_bytes());
    key.extend_from_slice(source.as_bytes());
    key.extend_from_slice(id.as_bytes());
    Ok(key)
}

/// The idempotency key for a downstream call made while processing a message: the same
/// stored key and step always give the same string, across restarts and versions of idemdb.
///
/// Derivation (part of the format, docs/design.md): `"idk1-"` followed by the 32 lowercase hex
/// digits of XXH3-128 (seed 0) over `"idemdb.derive.v1"`, then the stored key and the step,
/// each preceded by its length as a u32 big-endian.
///
/// ```
/// let key = idemdb::format::encode_key(b"billing", b"order-42")?;
/// let downstream = idemdb::format::derive_key(&key, "charge-card");
/// assert!(downstream.starts_with("idk1-") && downstream.len() == 5 + 32);
/// # Ok::<(), idemdb::Error>(())
/// ```
#[must_use]
pub fn derive_key(stored_key: &[u8], step: &str) -> String {
    const TAG: &[u8] = b"idemdb.derive.v1";
    let mut input = Vec::with_capacity(TAG.len() + 8 + stored_key.len() + step.len());
    input.extend_from_slice(TAG);
    for part in [stored_key, step.as_bytes()] {
        // Stored keys and steps are far below 4 GiB; saturate rather than wrap if not.
        let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
        input.extend_from_slice(&len.to_be_bytes());
        input.extend_from_slice(part);
    }
    format!("idk1-{:032x}", xxhash_rust::xxh3::xxh3_128(&input))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::error::Error;
    use proptest::prelude::*;

    #[test]
    fn layout_is_length_prefixed() {
        let key = encode_key(b"ab", b"xyz").unwrap();
        assert_eq!(key, b"\x02abxyz");
    }

    #[test]
    fn limits_are_typed_errors() {
        let long_consumer = vec![b'c'; CONSUMER_ID_BYTES_MAX + 1];
        let long_key = vec![b'k'; MESSAGE_KEY_BYTES_MAX + 1];
        for (consumer, key, limit) in [
            (&b""[..], &b"k"[..], Limit::ConsumerIdBytes),
            (&long_consumer[..], &b"k"[..], Limit::ConsumerIdBytes),
            (&b"c"[..], &b""[..], Limit::MessageKeyBytes),
            (&b"c"[..], &long_key[..], Limit::MessageKeyBytes),
        ] {
            match encode_key(consumer, key) {
                Err(Error::LimitExceeded { limit: got, .. }) => assert_eq!(got, limit),
                other => panic!("expected {limit:?} error, got {other:?}"),
            }
        }
        // The bounds themselves are accepted.
        encode_key(
            &long_consumer[..CONSUMER_ID_BYTES_MAX],
            &long_key[..MESSAGE_KEY_BYTES_MAX],
        )
        .unwrap();
    }

    #[test]
    fn decode_rejects_malformed_keys() {
        assert!(decode_key(b"").is_err());
        assert!(decode_key(b"\x00abc").is_err());
        assert!(decode_key(b"\x05ab").is_err());
        assert!(decode_key(b"\x02ab").is_err()); // empty message key
    }

    #[test]
    fn derived_keys_are_pinned() {
        // These strings are part of the format: downstream services dedup on them, so they must
        // not change between versions.
        let key = encode_key(b"billing", b"order-42").unwrap();
        assert_eq!(derive_key(&key, "charge"), DERIVED_CHARGE);
        assert_ne!(derive_key(&key, "charge"), derive_key(&key, "refund"));
        let other = encode_key(b"billing", b"order-43").unwrap();
        assert_ne!(derive_key(&key, "charge"), derive_key(&other, "charge"));
    }

    const DERIVED_CHARGE: &str = "idk1-71e4434e507f3c213144d05999a08f34";

    #[test]
    fn cloudevents_keys_are_injective_and_bounded() {
        assert_ne!(
            cloudevents_key("ab", "c").unwrap(),
            cloudevents_key("a", "bc").unwrap()
        );
        assert!(cloudevents_key("", "id").is_err());
        assert!(cloudevents_key("src", "").is_err());
        assert!(cloudevents_key("s", &"i".repeat(MESSAGE_KEY_BYTES_MAX)).is_err());
    }

    fn part(max: usize) -> impl Strategy<Value = Vec<u8>> {
        // Small alphabets make collisions between different splits likely if the codec were
        // not injective.
        prop::collection::vec(
            prop_oneof![Just(0u8), Just(1u8), Just(b'a'), any::<u8>()],
            1..=max,
        )
    }

    proptest! {
        #[test]
        fn round_trip(consumer in part(CONSUMER_ID_BYTES_MAX), key in part(64)) {
            let stored = encode_key(&consumer, &key).unwrap();
            let (c, k) = decode_key(&stored).unwrap();
            prop_assert_eq!(c, &consumer[..]);
            prop_assert_eq!(k, &key[..]);
        }

        #[test]
        fn injective(a in (part(4), part(4)), b in (part(4), part(4))) {
            let stored_a = encode_key(&a.0, &a.1).unwrap();
            let stored_b = encode_key(&b.0, &b.1).unwrap();
            prop_assert_eq!(stored_a == stored_b, a == b);
        }

        #[test]
        fn one_consumer_sorts_by_message_key(consumer in part(8), x in part(8), y in part(8)) {
            let stored_x = encode_key(&consumer, &x).unwrap();
            let stored_y = encode_key(&consumer, &y).unwrap();
            prop_assert_eq!(stored_x.cmp(&stored_y), x.cmp(&y));
        }
    }
}
