//! Ready-made merge operators for business tables.

/// A counter, associative (declare it with [`crate::TableOptions::associative_merge_operator`]):
/// the value is a `u64` in 8 big-endian bytes, each operand a `u64` (8 big-endian
/// bytes) to add, wrapping on overflow. An absent value counts as 0. Returns `None` (the read
/// fails) if the value or an operand is not exactly 8 bytes.
///
/// ```
/// use idemdb::merge_ops::add_u64;
/// let one = 1u64.to_be_bytes();
/// let two = 2u64.to_be_bytes();
/// let merged = add_u64(b"key", Some(&one), &[&two, &two]).unwrap();
/// assert_eq!(u64::from_be_bytes(merged.try_into().unwrap()), 5);
/// ```
#[must_use]
pub fn add_u64(_key: &[u8], existing: Option<&[u8]>, operands: &[&[u8]]) -> Option<Vec<u8>> {
    let decode = |bytes: &[u8]| <[u8; 8]>::try_from(bytes).ok().map(u64::from_be_bytes);
    let mut total = match existing {
        Some(bytes) => decode(bytes)?,
        None => 0,
    };
    for operand in operands {
        total = total.wrapping_add(decode(operand)?);
    }
    Some(total.to_be_bytes().to_vec())
}

/// Decodes a counter written by [`add_u64`].
#[must_use]
pub fn read_u64(value: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(value).ok().map(u64::from_be_bytes)
}
