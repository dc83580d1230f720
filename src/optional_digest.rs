//! How a digest that may not have been computed is written: `None` in
//! memory, an empty string in a sidecar or an offer, as earlier versions
//! wrote it there (and as they still read a digest they hold as a plain
//! string: a master's `md5`). For `#[serde(with)]` (or `deserialize_with`
//! alone, for a digest earlier versions read as optional). It knows nothing
//! of which digest it is or where it is kept.

use serde::{Deserialize, Deserializer, Serializer};

/// Reads a digest written as a string, null or empty when it was not
/// computed (earlier versions wrote an empty string), as `None` then.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.filter(|s| !s.is_empty()))
}

/// Writes a digest as a string, empty when it was not computed: what
/// earlier versions, which hold it as a plain string, can read.
pub fn serialize<S: Serializer>(digest: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(digest.as_deref().unwrap_or_default())
}
