//! The one error type of the worker, carrying the closed list of error codes
//! that completion events publish (`schemas/completion.v1.json`).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// Machine-readable error codes of the completion event. Other programs switch on
/// these strings, so the list is closed and mirrored in the JSON schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The message (command or notification) could not be parsed or validated.
    InvalidMessage,
    /// The node UUID is not a canonical UUID (it would be used in paths).
    InvalidNodeUuid,
    /// The image source answered that the image does not exist (404/410, missing file).
    SourceNotFound,
    /// The image source could not be reached or broke off (timeouts, 5xx, resets).
    SourceUnreachable,
    /// The source refused or is not allowed (file:// outside the allowed paths, swift,
    /// 401/403 from the source, Keystone or Glance).
    SourceNotAllowed,
    /// The downloaded bytes do not match the expected checksum.
    ChecksumMismatch,
    /// The checksum given is of a kind the configuration refuses, as Ironic
    /// does: MD5 with `[agent]allow_md5_checksum = false`, a checksum file
    /// URL with `[conductor]disable_support_for_checksum_files = true`.
    ChecksumNotPermitted,
    /// The detected format differs from the declared `image_disk_format`.
    FormatMismatch,
    /// The detected format is not in `[conductor]permitted_image_formats`.
    FormatNotPermitted,
    /// The image is structurally valid but dangerous (backing file, data file, encryption...).
    UnsafeImage,
    /// The image is malformed or could not be converted.
    CorruptImage,
    /// Not enough disk space for the download or the conversion.
    InsufficientDiskSpace,
    /// The command's deadline (its AMQP `expiration`, counted from its first
    /// delivery) passed before its work could start: nobody waits for it.
    Expired,
    /// Anything else: a bug or an unexpected local failure.
    Internal,
    /// The request is older than a later cleanup, `deployed` or transition
    /// of its node (or than its age limit): refused, nothing done.
    StaleRequest,
}

impl ErrorCode {
    /// Every code, in schema order; the schema test checks both lists agree.
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::InvalidMessage,
        ErrorCode::InvalidNodeUuid,
        ErrorCode::SourceNotFound,
        ErrorCode::SourceUnreachable,
        ErrorCode::SourceNotAllowed,
        ErrorCode::ChecksumMismatch,
        ErrorCode::ChecksumNotPermitted,
        ErrorCode::FormatMismatch,
        ErrorCode::FormatNotPermitted,
        ErrorCode::UnsafeImage,
        ErrorCode::CorruptImage,
        ErrorCode::InsufficientDiskSpace,
        ErrorCode::Expired,
        ErrorCode::Internal,
        ErrorCode::StaleRequest,
    ];

    /// The wire name of the code (as in the schema).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidMessage => "invalid_message",
            ErrorCode::InvalidNodeUuid => "invalid_node_uuid",
            ErrorCode::SourceNotFound => "source_not_found",
            ErrorCode::SourceUnreachable => "source_unreachable",
            ErrorCode::SourceNotAllowed => "source_not_allowed",
            ErrorCode::ChecksumMismatch => "checksum_mismatch",
            ErrorCode::ChecksumNotPermitted => "checksum_not_permitted",
            ErrorCode::FormatMismatch => "format_mismatch",
            ErrorCode::FormatNotPermitted => "format_not_permitted",
            ErrorCode::UnsafeImage => "unsafe_image",
            ErrorCode::CorruptImage => "corrupt_image",
            ErrorCode::InsufficientDiskSpace => "insufficient_disk_space",
            ErrorCode::Expired => "expired",
            ErrorCode::Internal => "internal",
            ErrorCode::StaleRequest => "stale_request",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error with its wire code and a human message; every fallible step of the
/// pipeline returns it so that the completion event can always be built.
/// The cause it came from, when there is one, stays with it for logs and
/// for decisions that look at the cause rather than the text (an OS error
/// number); it is not on the wire.
#[derive(Debug, Clone)]
pub struct Error {
    /// The closed-list code published in the completion event.
    pub code: ErrorCode,
    /// A message for the operator (no secrets: URLs are stripped of credentials).
    pub message: String,
    /// What failed underneath (an I/O, HTTP or TLS error).
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

/// Two errors are the same when they say the same on the wire.
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.code == other.code && self.message == other.message
    }
}

impl Eq for Error {}

impl Error {
    /// Builds an error from a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Error {
            code,
            message: message.into(),
            cause: None,
        }
    }

    /// The same error, remembering `cause` as where it came from.
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(cause));
        self
    }

    /// Wraps a local I/O failure, mapping ENOSPC/EDQUOT to `insufficient_disk_space`.
    pub fn io(context: impl fmt::Display, err: std::io::Error) -> Self {
        let code = match err.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => ErrorCode::InsufficientDiskSpace,
            _ if err.kind() == std::io::ErrorKind::StorageFull => ErrorCode::InsufficientDiskSpace,
            _ => ErrorCode::Internal,
        };
        Error::new(code, format!("{context}: {err}")).caused_by(err)
    }

    /// The OS error number of a local I/O failure, so callers can tell a
    /// condition that goes away (read-only, full) without reading text.
    pub fn os_error(&self) -> Option<i32> {
        self.cause
            .as_deref()?
            .downcast_ref::<std::io::Error>()?
            .raw_os_error()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|c| c as &(dyn std::error::Error + 'static))
    }
}

/// The error and its causes on one line, `outer: inner: innermost`, for
/// messages and logs: library errors (reqwest, hyper, lapin, I/O) keep the
/// useful part (refused, TLS, timeout) in their sources. A cause whose
/// text the line already holds is not repeated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let more = inner.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cur = inner.source();
    }
    text
}

/// The code for a failed HTTP status of an image source, Glance or
/// Keystone: gone is `source_not_found`, refused credentials are
/// `source_not_allowed`, anything else `source_unreachable`.
pub fn http_status_code(status: u16) -> ErrorCode {
    match status {
        404 | 410 => ErrorCode::SourceNotFound,
        401 | 403 => ErrorCode::SourceNotAllowed,
        _ => ErrorCode::SourceUnreachable,
    }
}

/// The worker's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
