//! What is on disk.
//!
//! Holds the master cache and its sidecars (`cache`), masters'
//! compressed forms (`compress`), Ironic's eviction
//! policy (`eviction`), per-node links (`link`) and their expiry
//! (`expiry`), named locks (`lock`), the per-node command ledger
//! (`ledger`), write-and-hash (`sink`) and checksums (`checksum`, `md5`).
//! Must not know any transport (AMQP, HTTP).

pub(crate) mod cache;
pub(crate) mod checksum;
pub(crate) mod compress;
pub(crate) mod eviction;
pub(crate) mod expiry;
pub(crate) mod ledger;
pub(crate) mod link;
pub(crate) mod lock;
pub(crate) mod md5;
pub(crate) mod sink;
mod zero_deflate;
