//! Integration tests of the public API, in one binary (one link of RocksDB).

mod admin;
mod async_commit;
mod backup;
mod bad_input;
mod batch;
mod checkpoint;
mod claim;
mod commit_log;
mod commit_log_growth;
mod corrupt;
mod default_log;
mod durability;
mod entity;
mod fault;
#[path = "../support/files.rs"]
mod files;
mod format2_docs;
mod full_disk;
mod guard;
mod lease;
mod limits;
mod model;
mod model_core;
mod observe;
mod open;
mod pipeline;
mod pipeline_docs;
mod positions;
mod race;
mod shrink_docs;
mod staging_docs;
#[path = "../support/tmpfs.rs"]
mod tmpfs;
mod ttl;
mod upgrade;
mod util;
