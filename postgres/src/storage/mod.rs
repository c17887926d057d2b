//! The storage layer: [`store::PgStore`] with its builder, the statements made once for its tables and
//! its clock, and the consumer handle [`store::PgConsumer`]; a record's row and its write
//! ([`records`]); staged read positions and their write ([`positions`]); the metrics and log events ([`observe`]). The operations above add the
//! claims to these types.

pub(crate) mod observe;
pub(crate) mod positions;
pub(crate) mod records;
pub(crate) mod store;
