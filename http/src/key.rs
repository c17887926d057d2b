//! The request's idempotency key and whose it is: the `Idempotency-Key` header parsed, the
//! principal that scopes it, and the key idemdb stores for the two.

use http::HeaderMap;
use http::header::HeaderName;

/// The request header carrying the key (the IETF httpapi draft "The Idempotency-Key HTTP
/// Header Field").
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest idempotency key accepted, in bytes (after the quotes and escapes of the draft's
/// string form are taken off). Clients send UUIDs (36 bytes) or similar; 255 leaves room for any scheme a
/// client may use and keeps the stored key within idemdb's limit with the longest principal.
pub const KEY_BYTES_MAX: usize = 255;

/// The longest principal, in bytes.
pub const PRINCIPAL_BYTES_MAX: usize = 255;

// The longest principal and key, with the principal's length byte, fit idemdb's message key: a
// key within these limits is never refused by the store.
const _: () = assert!(1 + PRINCIPAL_BYTES_MAX + KEY_BYTES_MAX <= idemdb::MESSAGE_KEY_BYTES_MAX);

/// Whose a key is: the authenticated caller (a tenant, an account, an API client) the keys are
/// scoped by. The same key sent by two principals names two requests, so one client can never
/// be answered with another's stored response. Every layer is built with the function that
/// gives a request's principal (every constructor of [`crate::IdempotencyLayer`] takes it).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal(Box<[u8]>);

/// A principal outside 1..=[`PRINCIPAL_BYTES_MAX`] bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a principal must be 1 to {PRINCIPAL_BYTES_MAX} bytes long, not {0}")]
pub struct InvalidPrincipal(pub usize);

impl Principal {
    /// A principal of `id`'s bytes (1..=[`PRINCIPAL_BYTES_MAX`]).
    ///
    /// # Errors
    /// [`InvalidPrincipal`] for an empty or longer id.
    pub fn new(id: impl AsRef<[u8]>) -> Result<Principal, InvalidPrincipal> {
        let id = id.as_ref();
        if id.is_empty() || id.len() > PRINCIPAL_BYTES_MAX {
            return Err(InvalidPrincipal(id.len()));
        }
        Ok(Principal(id.into()))
    }

    /// The principal's bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Principal({:?})", String::from_utf8_lossy(&self.0))
    }
}

/// Why a request's `Idempotency-Key` header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KeyProblem {
    /// More than one header: which one the client meant is a guess, and a wrong guess would
    /// replay another request's response.
    Repeated,
    /// Empty, longer than [`KEY_BYTES_MAX`], or neither a valid string nor a bare token.
    Malformed,
}

/// The request's key: `None` without the header. The draft's structured-field string form
/// (`"8e03978e"`: printable ASCII, spaces included, with `\"` and `\\` escapes) and a bare
/// token (`8e03978e`: visible ASCII, no spaces or double quotes) name the same key.
pub(crate) fn request_key(headers: &HeaderMap) -> Result<Option<Vec<u8>>, KeyProblem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyProblem::Repeated);
    }
    let key = match value.as_bytes() {
        [b'"', inner @ .., b'"'] => unescape(inner)?,
        // A lone or unbalanced double quote is a broken string, not part of a token.
        bare if bare
            .iter()
            .all(|&byte| (0x21..=0x7e).contains(&byte) && byte != b'"') =>
        {
            bare.to_vec()
        }
        _ => return Err(KeyProblem::Malformed),
    };
    if key.is_empty() || key.len() > KEY_BYTES_MAX {
        return Err(KeyProblem::Malformed);
    }
    Ok(Some(key))
}

/// The inside of a structured-field string: printable ASCII, `\"` and `\\` escapes only.
fn unescape(inner: &[u8]) -> Result<Vec<u8>, KeyProblem> {
    let mut key = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped),
                _ => return Err(KeyProblem::Malformed),
            },
            b'"' => return Err(KeyProblem::Malformed),
            0x20..=0x7e => key.push(byte),
            _ => return Err(KeyProblem::Malformed),
        }
    }
    Ok(key)
}

/// The message key idemdb stores for `key` sent by `principal`: the principal's length, the
/// principal, then the key, so that no two (principal, key) pairs meet in one stored key.
pub(crate) fn scoped_key(principal: &Principal, key: &[u8]) -> Vec<u8> {
    let mut scoped = Vec::with_capacity(1 + principal.0.len() + key.len());
    // At most PRINCIPAL_BYTES_MAX (255): the length fits a byte.
    scoped.push(principal.0.len() as u8);
    scoped.extend_from_slice(&principal.0);
    scoped.extend_from_slice(key);
    scoped
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key_of(values: &[&[u8]]) -> Result<Option<Vec<u8>>, KeyProblem> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(IDEMPOTENCY_KEY, HeaderValue::from_bytes(value).unwrap());
        }
        request_key(&headers)
    }

    #[test]
    fn the_string_form_and_the_bare_form_name_the_same_key() {
        assert_eq!(key_of(&[b"\"8e03978e\""]), Ok(Some(b"8e03978e".to_vec())));
        assert_eq!(key_of(&[b"8e03978e"]), Ok(Some(b"8e03978e".to_vec())));
        assert_eq!(
            key_of(&[b"\"a \\\"b\\\" \\\\\""]),
            Ok(Some(b"a \"b\" \\".to_vec()))
        );
    }

    #[test]
    fn missing_repeated_empty_long_and_malformed_keys_are_told_apart() {
        assert_eq!(key_of(&[]), Ok(None));
        assert_eq!(key_of(&[b"a", b"a"]), Err(KeyProblem::Repeated));
        assert_eq!(key_of(&[b"\"\""]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[b"\"a\\b\""]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[b"\"a\"b\""]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[b"a b"]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[b"\"a b\""]), Ok(Some(b"a b".to_vec())));
        assert_eq!(key_of(&[b"\"abc"]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[b"\""]), Err(KeyProblem::Malformed));
        assert_eq!(key_of(&[&[0xc3, 0xa9]]), Err(KeyProblem::Malformed));
        assert_eq!(
            key_of(&[&[b'k'; KEY_BYTES_MAX]]),
            Ok(Some(vec![b'k'; KEY_BYTES_MAX]))
        );
        assert_eq!(
            key_of(&[&[b'k'; KEY_BYTES_MAX + 1]]),
            Err(KeyProblem::Malformed)
        );
    }

    #[test]
    fn a_principal_and_a_key_never_meet_another_pair_in_one_stored_key() {
        let ab = Principal::new("ab").unwrap();
        let a = Principal::new("a").unwrap();
        assert_ne!(scoped_key(&ab, b"c"), scoped_key(&a, b"bc"));
        assert_eq!(Principal::new(""), Err(InvalidPrincipal(0)));
        assert_eq!(
            Principal::new(vec![1; PRINCIPAL_BYTES_MAX + 1]),
            Err(InvalidPrincipal(PRINCIPAL_BYTES_MAX + 1))
        );
        assert!(Principal::new(vec![1; PRINCIPAL_BYTES_MAX]).is_ok());
    }
}
