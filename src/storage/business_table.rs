//! The handle on a business table: claims stage writes into it by handle, and it reads the
//! table's current values.

use std::sync::Arc;

#[cfg(doc)]
use crate::format::error::Error;
use crate::format::error::Result;
use crate::storage::store::Storage;

/// A handle on a business table: claims stage writes into it; `get` reads it.
#[derive(Clone)]
pub struct BusinessTable {
    pub(crate) inner: Arc<Storage>,
    /// Position among the declared business tables.
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) has_merge_operator: bool,
}

impl BusinessTable {
    /// The current value under `key`, merges applied.
    ///
    /// # Errors
    /// [`Error::Storage`] if the read (or a merge) fails.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        Ok(self
            .inner
            .db()
            .get_cf(self.inner.business_cf(self.index), key)?)
    }

    /// The table's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Debug for BusinessTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusinessTable")
            .field("name", &self.name)
            .finish()
    }
}
