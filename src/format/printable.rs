//! Bytes rendered for humans, in error messages, logs and the operator tools.

/// Renders bytes for humans: the UTF-8 text when it is valid and has no control characters,
/// otherwise `0x` followed by lowercase hex.
#[must_use]
pub fn printable(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.chars().any(char::is_control) => text.to_owned(),
        _ => {
            let mut hex = String::with_capacity(2 + 2 * bytes.len());
            hex.push_str("0x");
            for byte in bytes {
                hex.push_str(&format!("{byte:02x}"));
            }
            hex
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_shows_text_or_hex() {
        assert_eq!(printable(b"order-1"), "order-1");
        assert_eq!(printable(b"\x00\xff"), "0x00ff");
        assert_eq!(printable(b"a\nb"), "0x610a62");
    }
}
