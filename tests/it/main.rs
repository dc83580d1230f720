//! The integration tests, built as one binary (one link of the whole
//! dependency tree instead of one per file). Each module is one area;
//! `common` holds the shared fixtures. Run one area with
//! `cargo test --test it -- <module>::`. The broker-restart test is a binary of
//! its own (`tests/broker_restart.rs`): it stops the broker that every
//! other test uses, so it must never run beside them.

mod common;

mod acks;
mod amqp;
mod backlog;
mod cache;
mod cluster;
mod compressed;
mod contracts;
mod convert;
mod corpus;
mod disk_full;
mod faults;
mod glance;
mod gzip;
mod http_hostile;
mod ironic_cache;
mod ironic_options;
mod ironic_plugin;
mod json_rpc;
mod ledger;
mod metal3;
mod metal3_pod;
mod metrics;
mod node_files;
mod notifications;
mod oci;
mod operators;
mod packaging;
mod peer_listener;
mod peer_trust;
mod peers;
mod pipeline;
mod rabbitmq_definitions;
mod sealed;
mod served_digests;
mod source_auth;
mod systemd;
mod tls;
mod warm;
mod web_servers;
