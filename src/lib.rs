//! ironic-image-worker: caches, converts, checksums and serves Ironic
//! instance images for the `direct` deploy interface, driven by RabbitMQ
//! or, for an Ironic without a broker, by JSON-RPC.
//!
//! # Layout
//!
//! | module | holds |
//! |---|---|
//! | [`cli`] | the command line: `serve`, one-shot `prepare`/`deployed`/`cleanup`, `cache`, `inspect`, `send`, `retire`, `config check`/`show` |
//! | `service` | the long-running `serve` process and systemd readiness |
//! | `broker` | AMQP: topology, session and reconnection, deliveries and their acknowledgement, publishing completions |
//! | `rpc` | the JSON-RPC listener: the commands for an Ironic without a broker |
//! | `dispatch` | what both transports share: per-node order, download slots, deadlines, the answers given |
//! | `messages` | request and completion types; parsing commands and Ironic notifications |
//! | `pipeline` | one request end to end: prepare, warm, deployed, cleanup; whether a cached or offered master fits a request; making a new master |
//! | `sources` | where bytes come from: http(s), `file://`, Glance, OCI registries, peers |
//! | `image` | format detection, the qcow2 validator, conversion to raw |
//! | [`image_format`] | the image formats as a type, by the one name a sidecar, an offer and the configuration give each |
//! | `store` | the master cache, eviction, node links, locks, write-and-hash, checksums |
//! | `http` | the image server and the operations listener (`/metrics`, `/healthz`, `/readyz`) |
//! | `metrics` | Prometheus metrics and transfer progress |
//! | [`config`] | configuration: a file per section, the layers (defaults, ironic.conf, TOML, environment, `--set`) with each value's source |
//! | `node` | the validated node UUID |
//! | `optional_digest` | a digest not computed: `None` in memory, an empty string in sidecars and offers, as earlier versions wrote it |
//! | `peers` | what the workers of one deployment say to each other: signed master URLs, sealed queries and offers |
//! | `gzip` | a master's compressed form: where it lives, the identity its header records (written by `store`, served by `http`) |
//! | `fsutil` | file-system helpers every layer may use (permissions, atomic replacement, the O_NOFOLLOW walk) |
//! | [`secrets`] | masking secrets (URL credentials and signatures, secret options) for every layer's logs, errors and files |
//! | `seal` | the seal (HMAC-SHA256, current and previous key) on commands and answers crossing the broker, and the canonical length-prefixed encoding every keyed or hashed record is built with |
//! | `retry` | the jittered exponential backoff of reconnects and download retries |
//! | [`error`] | the one error type and its closed list of codes |
//!
//! # How a request flows
//!
//! `broker` (a delivery) or `rpc` (a JSON-RPC call) turns its input into a
//! `messages` request (its node a `node` UUID read there, once: a node that
//! does not read is answered there) and hands it to `dispatch`, which keeps each node's
//! requests in order and calls the `pipeline` (a one-shot command in `cli`
//! calls the pipeline directly). The pipeline knows nothing of AMQP,
//! JSON-RPC or HTTP serving: `sources` streams the bytes, attempt by attempt, and the pipeline writes
//! each attempt through `store`'s sink (written and hashed in one pass,
//! verified), `image` inspects and, when asked, converts them,
//! `store` commits the master to the cache and links it for the node, and the
//! `http` image server serves the published symlink. The pipeline's
//! `Completion` goes back the way the request came.

pub(crate) mod broker;
pub mod cli;
pub(crate) mod clock;
pub mod config;
pub(crate) mod dispatch;
pub mod error;
pub(crate) mod fsutil;
pub(crate) mod gzip;
pub(crate) mod http;
pub mod image;
pub mod image_format;
pub(crate) mod messages;
pub(crate) mod metrics;
pub(crate) mod node;
pub(crate) mod optional_digest;
pub(crate) mod peers;
pub(crate) mod pipeline;
pub(crate) mod retry;
pub(crate) mod rpc;
pub(crate) mod seal;
pub mod secrets;
pub(crate) mod service;
pub(crate) mod sources;
pub(crate) mod store;
