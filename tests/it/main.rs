//! Integration tests of the public API, in one binary (one link of RocksDB).

mod claim;
mod durability;
mod entity;
mod limits;
mod model;
mod open;
mod race;
mod ttl;
mod util;
