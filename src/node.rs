//! Node identity: a validated, canonical node UUID. Node UUIDs become path
//! components (`<images_path>/<uuid>/disk`, `<http_root>/agent_images/<uuid>`),
//! so nothing but the canonical hyphenated form is ever accepted.

use crate::error::{Error, ErrorCode, Result};
use std::fmt;

/// A node UUID in canonical lowercase `8-4-4-4-12` form.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeUuid(String);

impl NodeUuid {
    /// Validates `raw` (hyphenated hex only; upper case is folded to lower).
    pub fn parse(raw: &str) -> Result<NodeUuid> {
        let ok = raw.len() == 36
            && raw.char_indices().all(|(i, c)| match i {
                8 | 13 | 18 | 23 => c == '-',
                _ => c.is_ascii_hexdigit(),
            });
        if ok {
            Ok(NodeUuid(raw.to_ascii_lowercase()))
        } else {
            let shown: String = raw.chars().take(64).collect();
            Err(Error::new(
                ErrorCode::InvalidNodeUuid,
                format!("node UUID {shown:?} is not a canonical UUID"),
            ))
        }
    }

    /// The canonical string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// True when `name` is a single, harmless path component (no separators, not
/// `.`/`..`, no NUL), as configuration-provided directory names must be.
pub fn is_valid_segment(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_canonical_and_folds_case() {
        let n = NodeUuid::parse("1BE26C0B-03F2-4D2E-AE87-C02D7F33C123").unwrap();
        assert_eq!(n.as_str(), "1be26c0b-03f2-4d2e-ae87-c02d7f33c123");
    }

    #[test]
    fn rejects_paths_and_other_forms() {
        for bad in [
            "",
            "../../etc/passwd",
            "1be26c0b03f24d2eae87c02d7f33c123",
            "1be26c0b-03f2-4d2e-ae87-c02d7f33c12/",
            "1be26c0b-03f2-4d2e-ae87-c02d7f33c1234",
            "{1be26c0b-03f2-4d2e-ae87-c02d7f33c12}",
        ] {
            assert_eq!(
                NodeUuid::parse(bad).unwrap_err().code,
                ErrorCode::InvalidNodeUuid,
                "{bad}"
            );
        }
    }
}
