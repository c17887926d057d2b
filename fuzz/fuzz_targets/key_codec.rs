//! Key codec: round trip, injectivity and per-consumer order of composite keys, and decoding of
//! arbitrary bytes without panics.
#![no_main]

use idemdb::format::{decode_key, encode_key};
use libfuzzer_sys::fuzz_target;

/// Splits the input into two (consumer, key) pairs using the first four bytes as lengths.
fn pairs(data: &[u8]) -> Option<[(&[u8], &[u8]); 2]> {
    let (lengths, mut rest) = data.split_first_chunk::<4>()?;
    let mut take = |len: u8| {
        let len = usize::from(len).min(rest.len());
        let (part, tail) = rest.split_at(len);
        rest = tail;
        part
    };
    let a = (take(lengths[0]), take(lengths[1]));
    let b = (take(lengths[2]), take(lengths[3]));
    Some([a, b])
}

fuzz_target!(|data: &[u8]| {
    // Any bytes: decoding never panics, and whatever decodes re-encodes to the same bytes.
    if let Ok((consumer, key)) = decode_key(data) {
        assert_eq!(encode_key(consumer, key).unwrap(), data);
    }

    let Some([a, b]) = pairs(data) else { return };
    let (Ok(encoded_a), Ok(encoded_b)) = (encode_key(a.0, a.1), encode_key(b.0, b.1)) else {
        // Out-of-limit inputs are typed errors (the call returned instead of panicking).
        return;
    };
    assert_eq!(decode_key(&encoded_a).unwrap(), a);
    // Injective: equal encodings only for equal pairs.
    assert_eq!(encoded_a == encoded_b, a == b);
    // One consumer's keys sort by message key.
    if a.0 == b.0 {
        assert_eq!(encoded_a.cmp(&encoded_b), a.1.cmp(b.1));
    }
});
