//! The operations layer: what a consumer does with a key, on the storage below. A claim
//! ([`claim`]), a batch of claims ([`batch`]), work under a fenced lease ([`lease`]), and the
//! business writes both claim types stage until their commit ([`staging`]), and the read
//! positions of log consumers written with them ([`position`]), and several commits kept in
//! flight from one thread ([`pipeline`]). Each decides
//! through the decision core and writes through [`crate::storage::store::Storage::write`].

pub(crate) mod batch;
pub(crate) mod claim;
pub(crate) mod lease;
pub(crate) mod pipeline;
pub(crate) mod position;
pub(crate) mod staging;
