//! ironic-image-worker: caches, converts, checksums and serves Ironic
//! instance images for the `direct` deploy interface, driven by RabbitMQ.
//!
//! The pipeline (`source` -> `inspect` -> `cache` -> `link`) is independent
//! of how requests arrive; `cli` and `serve` drive it.

pub mod broker;
pub mod cache;
pub mod checksum;
pub mod cli;
pub mod client;
pub mod config;
pub mod convert;
pub mod error;
pub mod events;
pub mod eviction;
pub mod fsutil;
pub mod glance;
pub mod http;
pub(crate) mod http_client;
pub mod inbound;
pub mod inspect;
pub mod ironic_conf;
pub mod link;
pub(crate) mod listener;
pub mod lock;
pub mod metrics;
pub mod node;
pub mod pipeline;
pub mod progress;
pub mod qcow2;
pub(crate) mod ranges;
pub mod sd_notify;
pub mod serve;
pub mod sink;
pub mod source;
