//! Image formats.
//!
//! Holds format detection from the bytes (`inspect`), our own qcow2 header
//! validator and cluster map (`qcow2`), compressed cluster decoding as qemu
//! decodes them (`inflate`) on every core in guest order (`clusters`),
//! conversion to raw (`convert`, its child's report lines in `reports`, the
//! download it may read while it grows in `growing`) and the release of a
//! converted download's pages as it is read (`reclaim`). Inspection always
//! stands before conversion. Must not know where the bytes came from or go.

pub(crate) mod clusters;
pub(crate) mod convert;
pub(crate) mod growing;
pub(crate) mod inflate;
pub(crate) mod inspect;
pub mod qcow2;
pub(crate) mod reclaim;
pub(crate) mod reports;
