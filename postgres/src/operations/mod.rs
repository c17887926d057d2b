//! What consumers and operators do with the store: a claim and its commit ([`claim`]), a
//! message's SQL run once ([`apply`]), batches ([`batch`], [`batch_commit`]), external claims
//! ([`external`]) and their lease steps ([`lease`]) and tickets ([`ticket`]), removal
//! ([`maintain`]), log consumers' read positions ([`positions`]), and export and import
//! ([`transfer`]).

pub(crate) mod apply;
pub(crate) mod batch;
pub(crate) mod batch_commit;
pub(crate) mod claim;
pub(crate) mod external;
pub(crate) mod lease;
pub(crate) mod maintain;
pub(crate) mod positions;
pub(crate) mod ticket;
pub(crate) mod transfer;
