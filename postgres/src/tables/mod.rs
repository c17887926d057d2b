//! The tables idemdb keeps in PostgreSQL: their names ([`names`]), their versioned
//! installation and migrations ([`install`]), and the advisory locks installers take turns
//! under ([`locks`]).

pub(crate) mod install;
pub(crate) mod locks;
pub(crate) mod names;
