//! The messages the worker exchanges: what a request asks for (`Command`,
//! `schemas/command.v1.json`) and what it answers (`Completion`,
//! `schemas/completion.v1.json`).
//!
//! # This folder
//!
//! Holds the request and completion types (`request` and this file) and the
//! parsing of inbound messages into requests (`inbound`: telling the kinds
//! apart in `mod.rs`, commands in `command`, Ironic notifications in
//! `notification`). Must not know AMQP channels or files.

pub(crate) mod inbound;
mod request;

pub use request::{DownloadTurn, Request, SlowSignal, Turns};

use crate::error::{Error, ErrorCode};
use serde::{Deserialize, Serialize};

/// What is asked: for a node, or (`Warm`) for an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Cache the image, link it for the node and publish its URL.
    Prepare,
    /// The node is deployed: withdraw the URL and the node's link.
    Deployed,
    /// The node is torn down: withdraw the URL and remove the node's image.
    Cleanup,
    /// Cache an image before any node asks for it, so the first deploy of
    /// it is a cache hit (names an image, not a node).
    Warm,
    /// The message could not be read far enough to know (error events only).
    Unknown,
}

impl Action {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Prepare => "prepare",
            Action::Deployed => "deployed",
            Action::Cleanup => "cleanup",
            Action::Warm => "warm",
            Action::Unknown => "unknown",
        }
    }
}

/// Why a message is settled without an answer: the `reason` label of
/// `ignored_messages_total`. A type rather than free strings, so no call
/// site can count under a label that the documentation, the alert rules
/// and the tests do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IgnoreReason {
    /// A notification not published by this host's conductor.
    OtherPublisher,
    /// A notification of an event other than a provision state's change.
    OtherEvent,
    /// A notification about a node whose deploy interface is not one of
    /// `[notifications]deploy_interfaces`.
    OtherDeployInterface,
    /// A node's transition that asks for no work.
    NoAction,
    /// A copy of work answered already, by another process of this host.
    AnsweredElsewhere,
    /// Work only for a node prepared here (a notification's release), and
    /// the node was not.
    NotPreparedHere,
    /// A redelivered copy of work still running here (adopted) or answered
    /// here already (settled).
    RedeliveredInProgress,
    /// A prepare put back at the tail of the queue: every download slot was
    /// busy.
    DeferredPrepare,
    /// A command without a seal, with a seal required: dead-lettered.
    Unsealed,
    /// A command whose seal does not hold (forged, made with a key not
    /// held, or re-published to another routing key, `reply_to` or
    /// `correlation_id`, or to another worker): dead-lettered.
    BadSeal,
    /// A notification's deployed, cleanup or transition while commands
    /// are sealed: a notification cannot be, so it changes no node's files
    /// (its prepare only warms the image).
    UnsealedNotification,
}

impl IgnoreReason {
    /// The label value: a documented contract (docs/contract.md,
    /// docs/operations.md, the alert rules), never to change.
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoreReason::OtherPublisher => "other_publisher",
            IgnoreReason::OtherEvent => "other_event",
            IgnoreReason::OtherDeployInterface => "other_deploy_interface",
            IgnoreReason::NoAction => "no_action",
            IgnoreReason::AnsweredElsewhere => "answered_elsewhere",
            IgnoreReason::NotPreparedHere => "not_prepared_here",
            IgnoreReason::RedeliveredInProgress => "redelivered_in_progress",
            IgnoreReason::DeferredPrepare => "deferred_prepare",
            IgnoreReason::Unsealed => "unsealed",
            IgnoreReason::BadSeal => "bad_seal",
            IgnoreReason::UnsealedNotification => "unsealed_notification",
        }
    }
}

/// The `instance_info` keys the worker reads (Ironic's names); other keys
/// (a configdrive, Ironic's own bookkeeping) are skipped unread: a
/// dead-lettered message keeps them in its original body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InstanceInfo {
    /// Image href: http(s) URL, file URL or Glance image id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_source: Option<String>,
    /// Legacy checksum (hex, `algo:hex`, or a checksum file URL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_checksum: Option<String>,
    /// Algorithm of `image_os_hash_value`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_os_hash_algo: Option<String>,
    /// Checksum (or checksum file URL) in `image_os_hash_algo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_os_hash_value: Option<String>,
    /// Declared format of the source (`raw`, `qcow2`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_disk_format: Option<String>,
    /// `whole-disk` or `partition`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_type: Option<String>,
    /// Kernel of a partition image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// Ramdisk of a partition image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ramdisk: Option<String>,
    /// Per-node override of `[agent]image_download_source`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_download_source: Option<String>,
    /// Credentials for an `oci://` registry (`user:pass`, its base64 as in
    /// a docker `config.json`, or a pre-shared token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<Secret>,
}

/// What a command says of the node beyond `instance_info`, as Ironic keeps
/// it (`driver_info`, `properties`): only what choosing an OCI artifact needs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// `properties.cpu_arch` (`x86_64`, `aarch64`, ...), which picks the
    /// artifact of a multi-architecture OCI index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_arch: Option<String>,
    /// `driver_info.image_pull_secret`, used when `instance_info` has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<Secret>,
}

impl NodeInfo {
    /// Refuses values longer than any real one (see `schemas/command.v1.json`).
    pub fn check_lengths(&self) -> Result<(), String> {
        if self
            .cpu_arch
            .as_ref()
            .is_some_and(|a| a.len() > MAX_NAME_LEN)
        {
            return Err(format!(
                "properties.cpu_arch is longer than {MAX_NAME_LEN} bytes"
            ));
        }
        let max = MAX_URL_LEN;
        if self
            .image_pull_secret
            .as_ref()
            .is_some_and(|s| s.0.len() > max)
        {
            return Err(format!(
                "driver_info.image_pull_secret is longer than {max} bytes"
            ));
        }
        Ok(())
    }
}

/// A credential from a message: serialized as it is (a forwarded command
/// keeps it), but never shown by `Debug`, so no log line can carry it.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Longest `request_id` (or notification `message_id`) accepted; it is
/// logged with every line of the request and echoed in its event.
pub const MAX_REQUEST_ID_LEN: usize = 255;

/// Longest `image_source` (or checksum URL) accepted: longer ones are not
/// URLs any HTTP stack takes, and would only fill logs.
pub const MAX_URL_LEN: usize = 8192;

/// Longest short `instance_info` value (formats, algorithm names, modes).
pub const MAX_NAME_LEN: usize = 64;

impl InstanceInfo {
    /// Refuses values longer than any real one (see `schemas/command.v1.json`
    /// `maxLength`): a 10 MB `image_source` would otherwise be logged and
    /// echoed with every line about the request.
    pub fn check_lengths(&self) -> Result<(), String> {
        let url = MAX_URL_LEN;
        let fields = [
            ("image_source", &self.image_source, url),
            ("image_checksum", &self.image_checksum, url),
            ("image_os_hash_value", &self.image_os_hash_value, url),
            ("kernel", &self.kernel, url),
            ("ramdisk", &self.ramdisk, url),
            ("image_os_hash_algo", &self.image_os_hash_algo, MAX_NAME_LEN),
            ("image_disk_format", &self.image_disk_format, MAX_NAME_LEN),
            ("image_type", &self.image_type, MAX_NAME_LEN),
            (
                "image_download_source",
                &self.image_download_source,
                MAX_NAME_LEN,
            ),
        ];
        if self
            .image_pull_secret
            .as_ref()
            .is_some_and(|s| s.0.len() > url)
        {
            return Err(format!(
                "instance_info.image_pull_secret is longer than {url} bytes"
            ));
        }
        for (name, value, max) in fields {
            if let Some(v) = value
                && v.len() > max
            {
                return Err(format!(
                    "instance_info.{name} is {} bytes long, more than {max}",
                    v.len()
                ));
            }
        }
        Ok(())
    }

    /// Whole-disk unless `image_type` says `partition`, or (without
    /// `image_type`) both `kernel` and `ramdisk` are set, as Ironic decides.
    pub fn is_whole_disk(&self) -> bool {
        let set = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.trim().is_empty());
        match self.image_type.as_deref().map(str::trim) {
            Some("partition") => false,
            Some(t) if !t.is_empty() => true,
            _ => !(set(&self.kernel) && set(&self.ramdisk)),
        }
    }
}

/// Per-request overrides of the worker's configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// Overrides `[DEFAULT]force_raw_images`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_raw: Option<bool>,
    /// Overrides `[agent]stream_raw_images`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_raw: Option<bool>,
}

/// Outcome of an action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Done.
    Success,
    /// Failed; see `error`.
    Error,
}

impl Status {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Success => "success",
            Status::Error => "error",
        }
    }
}

/// Whether a prepare found its image in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheOutcome {
    /// Served from an existing verified master.
    Hit,
    /// Downloaded (and converted) now.
    Miss,
    /// A warm in `image_download_source = http` mode of an http(s) source:
    /// deploys of it download from the source itself, so nothing was cached
    /// (the source was only checked, as a deploy checks it).
    #[serde(rename = "pass_through")]
    PassThrough,
}

impl CacheOutcome {
    /// Its name on the wire, in the logs and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheOutcome::Hit => "hit",
            CacheOutcome::Miss => "miss",
            CacheOutcome::PassThrough => "pass_through",
        }
    }
}

/// The `error` member of a failed completion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// Closed-list code.
    pub code: ErrorCode,
    /// Human message.
    pub message: String,
    /// The OS error number behind a local I/O failure (not on the wire):
    /// lets the broker layer retry a release on a transient one.
    #[serde(skip)]
    pub os_error: Option<i32>,
}

/// The completion event (docs/contract.md, "Completion events"): one per handled request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// The action answered.
    pub action: Action,
    /// success or error.
    pub status: Status,
    /// The node, when the request named a readable one (never on the wire
    /// for `warm`, which names no node: see [`Completion::to_json`]).
    pub node_uuid: Option<String>,
    /// Command `request_id` or notification `message_id`.
    pub request_id: Option<String>,
    /// The conductor host of the worker that answered.
    pub conductor_host: String,
    /// The `image_source` of a prepare.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_source: Option<String>,
    /// URL the agent downloads from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<String>,
    /// MD5 of exactly the bytes `image_url` serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_checksum: Option<String>,
    /// Algorithm of `image_os_hash_value`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_os_hash_algo: Option<String>,
    /// Digest of the served bytes in `image_os_hash_algo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_os_hash_value: Option<String>,
    /// Format of the served bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_disk_format: Option<String>,
    /// Size of the served bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<u64>,
    /// Whether the served bytes are a conversion of the source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub converted: Option<bool>,
    /// Cache hit or miss (prepare and warm; `pass_through` for warm only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheOutcome>,
    /// For an `oci://` source: the manifest the served artifact came from
    /// (`oci://<registry>/<repo>@sha256:<digest>`), as Ironic records it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci_image_manifest_url: Option<String>,
    /// Handling time.
    pub duration_ms: u64,
    /// Present only on error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

impl Completion {
    /// A bare completion for `action`; fields are filled by the caller.
    pub fn new(
        action: Action,
        node_uuid: Option<String>,
        request_id: Option<String>,
        conductor_host: &str,
    ) -> Completion {
        Completion {
            action,
            status: Status::Success,
            node_uuid,
            request_id,
            conductor_host: conductor_host.to_string(),
            image_source: None,
            image_url: None,
            image_checksum: None,
            image_os_hash_algo: None,
            image_os_hash_value: None,
            image_disk_format: None,
            image_size: None,
            converted: None,
            cache: None,
            oci_image_manifest_url: None,
            duration_ms: 0,
            error: None,
        }
    }

    /// The span of the lines written about this answer when no request
    /// was worked for it (an unusable message's error, a one-shot command
    /// refused): what of its node, request id and action could be read.
    pub fn span(&self) -> tracing::Span {
        request_span(
            self.node_uuid.as_deref().unwrap_or(""),
            self.request_id.as_deref(),
            self.action,
        )
    }

    /// The bare answer to `req`, for conductor `host`: its action, its
    /// node (canonical; none for a warm) and its request id.
    pub fn for_request(req: &Request, host: &str) -> Completion {
        let node = req.node.as_ref().map(ToString::to_string);
        Completion::new(req.action, node, req.request_id.clone(), host)
    }

    /// The wire form (`schemas/completion.v1.json`): as serialized, except
    /// that a `warm` answer has no `node_uuid` member at all (it names an
    /// image, not a node), where the other actions always carry one
    /// (`null` when the request named no readable node).
    pub fn to_json(&self) -> serde_json::Result<Vec<u8>> {
        let mut value = serde_json::to_value(self)?;
        if self.action == Action::Warm
            && let Some(map) = value.as_object_mut()
        {
            map.remove("node_uuid");
        }
        serde_json::to_vec(&value)
    }

    /// The routing key (and AMQP `type`) of this completion on the events
    /// exchange: `node.<action>.<status>`, or `image.warm.<status>` for a
    /// warm, whose subject is an image.
    pub fn event_kind(&self) -> String {
        let subject = match self.action {
            Action::Warm => "image",
            _ => "node",
        };
        format!(
            "{subject}.{}.{}",
            self.action.as_str(),
            self.status.as_str()
        )
    }

    /// Turns this completion into an error answer, dropping image fields that
    /// would otherwise suggest a usable image: it keeps only who asked, the
    /// `image_source` asked for and the handling time, so a field added to
    /// `Completion` is dropped too.
    pub fn failed(self, err: &Error) -> Completion {
        Completion {
            status: Status::Error,
            image_source: self.image_source,
            duration_ms: self.duration_ms,
            error: Some(ErrorBody {
                code: err.code,
                message: err.message.clone(),
                os_error: err.os_error(),
            }),
            ..Completion::new(
                self.action,
                self.node_uuid,
                self.request_id,
                &self.conductor_host,
            )
        }
    }
}

/// The one shape of a request's span, so that every line about one
/// request carries the same fields whatever it was built from. At error
/// level, so that it is on every line a filter lets through.
fn request_span(node: &str, request_id: Option<&str>, action: Action) -> tracing::Span {
    tracing::error_span!(
        "request",
        node = %node,
        request_id = request_id.unwrap_or(""),
        action = action.as_str()
    )
}

/// Whether a request's span ([`request_span`]) is the current one.
fn in_request_span() -> bool {
    tracing::Span::current()
        .metadata()
        .is_some_and(|m| m.name() == "request" && m.target() == module_path!())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line logged by the pipeline inside the dispatcher's span of the
    /// same request names the request once; alone (a one-shot command),
    /// it still names it.
    #[test]
    fn a_request_span_is_not_entered_twice() {
        #[derive(Clone, Default)]
        struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let req = Request {
            action: Action::Cleanup,
            node: crate::node::NodeUuid::parse("1be26c0b-03f2-4d2e-ae87-c02d7f33c123").ok(),
            request_id: Some("r-1".into()),
            instance_info: InstanceInfo::default(),
            options: Options::default(),
            node_info: NodeInfo::default(),
            only_if_prepared: false,
            slow: SlowSignal::default(),
            turn: Default::default(),
            issued_ms: None,
            notified: false,
        };
        tracing::subscriber::with_default(subscriber, || {
            req.span().in_scope(|| {
                req.span_once()
                    .in_scope(|| tracing::info!("inside the dispatcher"))
            });
            req.span_once().in_scope(|| tracing::info!("alone"));
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        for line in lines {
            assert_eq!(line.matches("request{").count(), 1, "{line}");
            assert!(line.contains("request_id=\"r-1\""), "{line}");
        }
    }

    /// The `reason` labels are a contract (dashboards, alerts, the
    /// integration tests read them): each reason keeps its label.
    #[test]
    fn ignore_reasons_keep_their_labels() {
        use IgnoreReason::*;
        let labels = [
            (OtherPublisher, "other_publisher"),
            (OtherEvent, "other_event"),
            (OtherDeployInterface, "other_deploy_interface"),
            (NoAction, "no_action"),
            (AnsweredElsewhere, "answered_elsewhere"),
            (NotPreparedHere, "not_prepared_here"),
            (RedeliveredInProgress, "redelivered_in_progress"),
            (DeferredPrepare, "deferred_prepare"),
            (Unsealed, "unsealed"),
            (BadSeal, "bad_seal"),
            (UnsealedNotification, "unsealed_notification"),
        ];
        for (reason, label) in labels {
            assert_eq!(reason.as_str(), label);
        }
    }

    /// An error answer keeps who asked, what for and how long it took, and
    /// no field that could pass for a usable image.
    #[test]
    fn a_failed_completion_keeps_only_the_request_and_the_error() {
        let mut done = Completion::new(
            Action::Prepare,
            Some("node".into()),
            Some("req".into()),
            "host",
        );
        done.image_source = Some("http://source/img".into());
        done.image_url = Some("http://here/node".into());
        done.image_checksum = Some("md5".into());
        done.image_os_hash_algo = Some("sha256".into());
        done.image_os_hash_value = Some("hex".into());
        done.image_disk_format = Some("raw".into());
        done.image_size = Some(1);
        done.converted = Some(true);
        done.cache = Some(CacheOutcome::Hit);
        done.oci_image_manifest_url = Some("oci://r/i@sha256:0".into());
        done.duration_ms = 7;
        let err = Error::new(ErrorCode::CorruptImage, "bad");
        let json = serde_json::to_value(done.failed(&err)).unwrap();
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        keys.sort();
        let want = [
            "action",
            "conductor_host",
            "duration_ms",
            "error",
            "image_source",
            "node_uuid",
            "request_id",
            "status",
        ];
        assert_eq!(keys, want);
        assert_eq!(json["status"], "error");
        assert_eq!(json["duration_ms"], 7);
        assert_eq!(json["image_source"], "http://source/img");
        assert_eq!(json["error"]["code"], "corrupt_image");
    }
}
