//! Fingerprints: a 128-bit hash of the message content the caller considers immutable.

use std::fmt;

/// A 128-bit hash of the part of a message that must not change between redeliveries.
///
/// A redelivery whose fingerprint differs from the stored one is reported as
/// [`crate::Outcome::Conflict`]: the producer reused an id, or the message changed in flight.
/// [`Fingerprint::of`] hashes bytes with XXH3-128, which is stable across versions and platforms
/// (it is part of what the stored record means, see docs/design.md).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Fingerprint(u128);

impl Fingerprint {
    /// The fingerprint of `content`: XXH3-128 with the default seed.
    ///
    /// ```
    /// use idemdb::Fingerprint;
    /// assert_eq!(Fingerprint::of(b"order 42: 3 apples"), Fingerprint::of(b"order 42: 3 apples"));
    /// assert_ne!(Fingerprint::of(b"order 42: 3 apples"), Fingerprint::of(b"order 42: 4 apples"));
    /// ```
    #[must_use]
    pub fn of(content: impl AsRef<[u8]>) -> Fingerprint {
        Fingerprint(xxhash_rust::xxh3::xxh3_128(content.as_ref()))
    }

    /// Wraps a fingerprint the caller computed some other way (for example a hash carried in the
    /// message headers).
    #[must_use]
    pub const fn from_u128(value: u128) -> Fingerprint {
        Fingerprint(value)
    }

    /// The raw 128-bit value.
    #[must_use]
    pub const fn as_u128(self) -> u128 {
        self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_value() {
        // XXH3-128 of the empty input with seed 0, as published by the reference implementation.
        // If this changes, every stored fingerprint changes meaning.
        assert_eq!(
            Fingerprint::of(b"").as_u128(),
            0x99aa06d3014798d86001c324468d497f
        );
    }

    #[test]
    fn displays_as_fixed_width_hex() {
        assert_eq!(
            Fingerprint::from_u128(0xab).to_string(),
            "000000000000000000000000000000ab"
        );
    }
}
