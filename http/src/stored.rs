//! A response as the claim's result stores it, and back: the status, the headers the layer
//! keeps, and the body, replayed byte for byte to every retry.
//!
//! Encoding (version 1): `[1][status: u16][header count: u16]`, then per header
//! `[name length: u16][name][value length: u16][value]`, then the body to the end. Big-endian.
//! The version byte lets a later release read what this one stored: records live as long as
//! the store's retention.

use bytes::{BufMut, Bytes};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const STORED_RESPONSE_V1: u8 = 1;

/// A stored response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    /// Keeps the headers of `headers` named in `kept`, every value of each, in order.
    pub(crate) fn new(
        status: StatusCode,
        headers: &HeaderMap,
        kept: &[HeaderName],
        body: Bytes,
    ) -> StoredResponse {
        let headers = kept
            .iter()
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .map(move |value| (name.clone(), value.clone()))
            })
            .collect();
        StoredResponse {
            status,
            headers,
            body,
        }
    }

    /// The bytes stored; `None` when a header does not fit its length field (64 KiB), which
    /// no header a server sends comes near.
    pub(crate) fn encode(&self) -> Option<Vec<u8>> {
        let headers_bytes: usize = self
            .headers
            .iter()
            .map(|(name, value)| 4 + name.as_str().len() + value.len())
            .sum();
        let mut bytes = Vec::with_capacity(5 + headers_bytes + self.body.len());
        bytes.put_u8(STORED_RESPONSE_V1);
        bytes.put_u16(self.status.as_u16());
        bytes.put_u16(u16::try_from(self.headers.len()).ok()?);
        for (name, value) in &self.headers {
            bytes.put_u16(u16::try_from(name.as_str().len()).ok()?);
            bytes.put_slice(name.as_str().as_bytes());
            bytes.put_u16(u16::try_from(value.len()).ok()?);
            bytes.put_slice(value.as_bytes());
        }
        bytes.put_slice(&self.body);
        Some(bytes)
    }

    /// `None` for bytes [`StoredResponse::encode`] did not produce.
    pub(crate) fn decode(stored: &Bytes) -> Option<StoredResponse> {
        let mut at = 0usize;
        let take = |at: &mut usize, n: usize| -> Option<Bytes> {
            let end = at.checked_add(n).filter(|&end| end <= stored.len())?;
            let taken = stored.slice(*at..end);
            *at = end;
            Some(taken)
        };
        let u16_at = |at: &mut usize| -> Option<u16> {
            let bytes = take(at, 2)?;
            Some(u16::from_be_bytes([bytes[0], bytes[1]]))
        };
        if take(&mut at, 1)?.as_ref() != [STORED_RESPONSE_V1] {
            return None;
        }
        let status = StatusCode::from_u16(u16_at(&mut at)?).ok()?;
        let count = u16_at(&mut at)?;
        let mut headers = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            let name_length = u16_at(&mut at)?;
            let name = HeaderName::from_bytes(&take(&mut at, usize::from(name_length))?).ok()?;
            let value_length = u16_at(&mut at)?;
            let value =
                HeaderValue::from_maybe_shared(take(&mut at, usize::from(value_length))?).ok()?;
            headers.push((name, value));
        }
        Some(StoredResponse {
            status,
            headers,
            body: stored.slice(at..),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{CONTENT_TYPE, LOCATION, SET_COOKIE};

    #[test]
    fn a_response_comes_back_as_it_was_stored_with_only_the_kept_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.append(SET_COOKIE, HeaderValue::from_static("a=1"));
        headers.append(SET_COOKIE, HeaderValue::from_static("b=2"));
        headers.insert(LOCATION, HeaderValue::from_static("/payments/7"));
        let stored = StoredResponse::new(
            StatusCode::CREATED,
            &headers,
            &[CONTENT_TYPE, SET_COOKIE],
            Bytes::from_static(b"{\"id\":7}"),
        );
        assert_eq!(stored.headers.len(), 3);
        let bytes = Bytes::from(stored.encode().unwrap());
        assert_eq!(StoredResponse::decode(&bytes), Some(stored));
    }

    #[test]
    fn bytes_it_did_not_write_do_not_decode() {
        let stored = StoredResponse::new(
            StatusCode::OK,
            &HeaderMap::new(),
            &[],
            Bytes::from_static(b"body"),
        );
        let bytes = stored.encode().unwrap();
        for cut in 0..5 {
            assert_eq!(
                StoredResponse::decode(&Bytes::copy_from_slice(&bytes[..cut])),
                None
            );
        }
        let mut other_version = bytes.clone();
        other_version[0] = 2;
        assert_eq!(StoredResponse::decode(&Bytes::from(other_version)), None);
        let mut bad_status = bytes;
        bad_status[1..3].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(StoredResponse::decode(&Bytes::from(bad_status)), None);
    }
}
