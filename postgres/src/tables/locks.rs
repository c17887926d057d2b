//! The advisory locks installers and removals take turns under: 64-bit hashes of what they
//! stand for.

use crate::tables::names::Names;

/// The advisory lock installers into the schema of `names` take turns under, before
/// [`install_lock`].
pub(crate) fn schema_install_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb install schema {}", names.schema))
}

/// The advisory lock installers of `names` take turns under.
pub(crate) fn install_lock(names: &Names) -> i64 {
    advisory_lock_of(&format!("idemdb install {}", names.records()))
}

/// An advisory lock's number: a 64-bit hash of what it stands for.
pub(crate) fn advisory_lock_of(what: &str) -> i64 {
    i64::from_ne_bytes(xxhash_rust::xxh3::xxh3_64(what.as_bytes()).to_ne_bytes())
}
