//! The variable-length integers of record format 2 (docs/design.md section 4): seven bits a
//! byte, the lowest first, the high bit set on every byte but the last (LEB128), and the zigzag
//! map that gives a signed difference a short encoding whichever its sign.
//!
//! Decoding accepts only the shortest encoding of each value, so that a record decodes and
//! encodes back to the same bytes (the `record_decoder` fuzz target checks it). Written here
//! rather than taken from a crate: the one checked let a tenth byte carry bits past the 64th
//! and silently dropped them.

use crate::format::error::DecodeError;

/// The most bytes a `u64` takes: ten, the tenth carrying its highest bit.
pub(crate) const U64_BYTES_MAX: usize = 10;

/// Writes `value` into `out` at `*at` and moves `*at` past it.
///
/// # Panics
/// If `out` has fewer than [`U64_BYTES_MAX`] bytes from `*at` and `value` needs them; callers
/// size their buffers for the longest encoding.
pub(crate) fn put(out: &mut [u8], at: &mut usize, mut value: u64) {
    while value >= 0x80 {
        out[*at] = (value & 0x7f) as u8 | 0x80;
        *at += 1;
        value >>= 7;
    }
    out[*at] = value as u8;
    *at += 1;
}

/// Reads the varint at `bytes[*at..]` and moves `*at` past it.
///
/// # Errors
/// [`DecodeError::Truncated`] when `bytes` ends inside it; [`DecodeError::Invalid`] for one
/// longer than its value needs or above `u64::MAX`.
// Always inlined: a record's header reads four, and as a call each cost about 50 instructions.
#[inline(always)]
pub(crate) fn read(bytes: &[u8], at: &mut usize) -> Result<u64, DecodeError> {
    // Up to 8 bytes at once, from one load: a record's varints are an epoch (1 byte), an instant
    // (6) and a retention (4-5). Read byte by byte, they cost a duplicate's lookup about 250
    // instructions (docs/bench/profile.md).
    if let Some(chunk) = bytes.get(*at..*at + 8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        // The high bit of each byte that ends a varint.
        let ends = !word & 0x8080_8080_8080_8080;
        if ends != 0 {
            let len = (ends.trailing_zeros() / 8 + 1) as usize;
            if len > 1 && (word >> (8 * (len - 1))) & 0xff == 0 {
                return Err(longer_than_needed());
            }
            *at += len;
            return Ok(gather(word, len));
        }
    }
    read_bytewise(bytes, at)
}

/// The value of a varint of `len` bytes (1 to 8) held in `word`'s low bytes: their low seven
/// bits, packed together (pairs, then quads, then the two halves).
#[inline(always)]
fn gather(word: u64, len: usize) -> u64 {
    let kept = if len == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * len)) - 1
    };
    let mut bits = word & kept & 0x7f7f_7f7f_7f7f_7f7f;
    bits = (bits & 0x007f_007f_007f_007f) | ((bits & 0x7f00_7f00_7f00_7f00) >> 1);
    bits = (bits & 0x0000_3fff_0000_3fff) | ((bits & 0x3fff_0000_3fff_0000) >> 2);
    (bits & 0x0000_0000_0fff_ffff) | ((bits & 0x0fff_ffff_0000_0000) >> 4)
}

/// [`read`] one byte at a time: a varint of 9 or 10 bytes, or one within 8 bytes of the end.
fn read_bytewise(bytes: &[u8], at: &mut usize) -> Result<u64, DecodeError> {
    let mut value = 0u64;
    for index in 0..U64_BYTES_MAX {
        let Some(&byte) = bytes.get(*at + index) else {
            return Err(DecodeError::Truncated {
                needed: *at + index + 1,
                available: bytes.len(),
            });
        };
        if index == U64_BYTES_MAX - 1 && byte > 1 {
            // The tenth byte holds bit 63 alone; anything more is past u64::MAX (or goes on).
            return Err(above_u64());
        }
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            if byte == 0 && index > 0 {
                return Err(longer_than_needed());
            }
            *at += index + 1;
            return Ok(value);
        }
    }
    // Not reached: the tenth byte either ends the varint or is refused above.
    Err(above_u64())
}

fn longer_than_needed() -> DecodeError {
    DecodeError::Invalid {
        reason: "a varint longer than its value needs",
    }
}

fn above_u64() -> DecodeError {
    DecodeError::Invalid {
        reason: "a varint above u64::MAX",
    }
}

/// Maps a difference taken modulo 2^64 (read as a signed number) to an unsigned one that is
/// small when the difference is small either way: 0, -1, 1, -2 ... become 0, 1, 2, 3 ...
pub(crate) fn zigzag(difference: u64) -> u64 {
    (difference << 1) ^ 0u64.wrapping_sub(difference >> 63)
}

/// The inverse of [`zigzag`].
pub(crate) fn unzigzag(encoded: u64) -> u64 {
    (encoded >> 1) ^ 0u64.wrapping_sub(encoded & 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(value: u64) -> Vec<u8> {
        let mut out = [0u8; U64_BYTES_MAX];
        let mut at = 0;
        put(&mut out, &mut at, value);
        out[..at].to_vec()
    }

    #[test]
    fn lengths_at_the_edges() {
        for (value, len) in [
            (0, 1),
            (0x7f, 1),
            (0x80, 2),
            (0x3fff, 2),
            (0x4000, 3),
            (1 << 41, 6),
            ((1 << 56) - 1, 8),
            (1 << 56, 9),
            (u64::MAX >> 1, 9),
            (u64::MAX, 10),
        ] {
            let bytes = encoded(value);
            assert_eq!(bytes.len(), len, "{value:#x}");
            // Alone (read byte by byte near the end) and followed by more (read a word at once).
            for tail in [0, 8] {
                let mut padded = bytes.clone();
                padded.resize(len + tail, 0xff);
                let mut at = 0;
                assert_eq!(read(&padded, &mut at), Ok(value), "{value:#x} + {tail}");
                assert_eq!(at, len);
            }
        }
    }

    #[test]
    fn refuses_longer_than_needed_past_u64_and_cut_short() {
        let invalid =
            |bytes: &[u8]| matches!(read(bytes, &mut 0), Err(DecodeError::Invalid { .. }));
        assert!(invalid(&[0x80, 0x00]), "zero in two bytes");
        assert!(invalid(&[0xff, 0x80, 0x00]), "0x7f in three bytes");
        assert!(
            invalid(&[0x80, 0x00, 1, 1, 1, 1, 1, 1, 1]),
            "zero in two bytes, read a word at once"
        );
        assert!(
            invalid(&[0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00, 1]),
            "1 in eight bytes"
        );
        let mut past = encoded(u64::MAX);
        past[9] = 0x02;
        assert!(invalid(&past), "a tenth byte above 1");
        let mut longer = encoded(u64::MAX);
        longer[9] = 0x81;
        longer.push(0x01);
        assert!(invalid(&longer), "an eleventh byte");
        assert_eq!(
            read(&[0x80, 0x80], &mut 0),
            Err(DecodeError::Truncated {
                needed: 3,
                available: 2
            })
        );
        assert!(matches!(
            read(&[], &mut 0),
            Err(DecodeError::Truncated { .. })
        ));
    }

    #[test]
    fn zigzag_keeps_small_differences_small() {
        assert_eq!(zigzag(0), 0);
        assert_eq!(zigzag(u64::MAX), 1); // -1
        assert_eq!(zigzag(1), 2);
        assert_eq!(zigzag(600_000), 1_200_000);
    }

    proptest! {
        #[test]
        fn round_trips(value in any::<u64>()) {
            let bytes = encoded(value);
            let mut at = 0;
            prop_assert_eq!(read(&bytes, &mut at), Ok(value));
            prop_assert_eq!(at, bytes.len());
            prop_assert_eq!(unzigzag(zigzag(value)), value);
        }

        #[test]
        fn the_word_at_a_time_and_the_bytewise_reads_agree(
            bytes in prop::collection::vec(any::<u8>(), 8..12),
        ) {
            let (mut word_at, mut byte_at) = (0, 0);
            let word = read(&bytes, &mut word_at);
            let bytewise = read_bytewise(&bytes, &mut byte_at);
            prop_assert_eq!(&word, &bytewise);
            if word.is_ok() {
                prop_assert_eq!(word_at, byte_at);
            }
        }

        #[test]
        fn what_decodes_encodes_back_the_same(bytes in prop::collection::vec(any::<u8>(), 0..12)) {
            let mut at = 0;
            if let Ok(value) = read(&bytes, &mut at) {
                prop_assert_eq!(encoded(value), &bytes[..at]);
            }
        }
    }
}
