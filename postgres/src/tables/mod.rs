//! The tables idemdb keeps in PostgreSQL: their names ([`names`]), their versioned
//! installation and migrations ([`install`]), the records table's day partitions
//! ([`partitions`]), and the advisory locks installers and removals take turns under
//! ([`locks`]).

pub(crate) mod install;
pub(crate) mod locks;
pub(crate) mod names;
pub(crate) mod partitions;
