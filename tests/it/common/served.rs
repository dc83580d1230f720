//! The one check that a completion describes exactly the bytes it serves:
//! `image_checksum` (the MD5, or its absence with `[agent] served_md5 =
//! false`), `image_os_hash_algo` and `image_os_hash_value` (sha256, or
//! sha512 when the request's algorithm was sha512) and `image_size`, against
//! the digests OpenSSL gives ([`openssl_digest`]) and the length of a file: the served
//! file itself (fetched with [`fetch_served`] or read from http_root) or the
//! reference it must equal (the source, or `qemu-img convert`'s output).
//!
//! The completion must be a success. A failure names every field that
//! disagreed, with the expected and actual values, the node and the URL of
//! the completion, and the file compared.

use super::openssl_digest;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `assert_served(&ev, &bytes)`: the completion `ev` announces MD5, sha256
/// and size of exactly the file `bytes`. See [`Served`] for the variants.
#[track_caller]
pub fn assert_served(ev: &Value, bytes: &Path) {
    served(bytes).check(ev);
}

/// The expectation on a completion's digests of `bytes`: by default an MD5
/// in `image_checksum` and the sha256 in `image_os_hash_*`.
pub fn served(bytes: &Path) -> Served {
    Served {
        bytes: bytes.to_path_buf(),
        algo: "sha256",
        md5: true,
        context: String::new(),
    }
}

/// What [`served`] builds; [`Served::check`] asserts it.
#[must_use = "nothing is checked until `check`"]
pub struct Served {
    bytes: PathBuf,
    algo: &'static str,
    md5: bool,
    context: String,
}

impl Served {
    /// `image_os_hash_*` is the sha512 (the request's algorithm was sha512).
    pub fn sha512(mut self) -> Served {
        self.algo = "sha512";
        self
    }

    /// No `image_checksum` at all (`[agent] served_md5 = false`).
    pub fn without_md5(mut self) -> Served {
        self.md5 = false;
        self
    }

    /// The file whose bytes the completion must describe.
    pub fn bytes(&self) -> &Path {
        &self.bytes
    }

    /// A word for the failure message (which case of a loop, say).
    pub fn context(mut self, context: impl std::fmt::Display) -> Served {
        self.context = context.to_string();
        self
    }

    /// Panics, naming each field that disagrees, unless `ev` is a success
    /// that describes the bytes of the file.
    #[track_caller]
    pub fn check(&self, ev: &Value) {
        let path = self.bytes.to_str().expect("a UTF-8 path");
        let size = std::fs::metadata(&self.bytes)
            .unwrap_or_else(|e| panic!("the bytes to compare, {path}: {e}"))
            .len();
        // The two digests at once: the files are up to gigabytes.
        let (md5, sha) = std::thread::scope(|s| {
            let md5 = s.spawn(|| self.md5.then(|| openssl_digest("md5", &self.bytes)));
            let sha = openssl_digest(self.algo, &self.bytes);
            (md5.join().unwrap(), sha)
        });
        let mut wrong = Vec::new();
        // Only a success serves bytes (a warm's has no node or URL: null).
        if ev["status"] != "success" {
            wrong.push(format!(
                "status: expected \"success\", actual {}",
                ev["status"]
            ));
        }
        let mut field = |name: &str, expected: Value| {
            let actual = ev.get(name).cloned().unwrap_or(Value::Null);
            if actual != expected {
                wrong.push(format!("{name}: expected {expected}, actual {actual}"));
            }
        };
        field("image_checksum", md5.map_or(Value::Null, Value::from));
        field("image_os_hash_algo", self.algo.into());
        field("image_os_hash_value", sha.into());
        field("image_size", size.into());
        if wrong.is_empty() {
            return;
        }
        let mut msg = String::from("the completion ");
        if !self.context.is_empty() {
            let _ = write!(msg, "({}) ", self.context);
        }
        let _ = write!(
            msg,
            "of node {} (image_url {}) does not describe the bytes of {path} \
             ({size} bytes; expected: md5 {}, {}):",
            ev.get("node_uuid").unwrap_or(&Value::Null),
            ev.get("image_url").unwrap_or(&Value::Null),
            if self.md5 { "present" } else { "absent" },
            self.algo,
        );
        for w in &wrong {
            let _ = write!(msg, "\n  {w}");
        }
        let _ = write!(msg, "\nthe completion: {ev}");
        panic!("{msg}");
    }
}

/// GETs the completion's `image_url` (it must answer 200) and writes the
/// body into `dir`; returns the file, named after the node.
pub async fn fetch_served(ev: &Value, dir: &Path) -> PathBuf {
    let url = ev["image_url"]
        .as_str()
        .unwrap_or_else(|| panic!("no image_url in the completion {ev}"));
    let (status, body) = super::get(url).await;
    assert_eq!(status, 200, "GET {url} (node {})", ev["node_uuid"]);
    let name = ev["node_uuid"].as_str().unwrap_or("served");
    let file = dir.join(format!("served-{name}"));
    std::fs::write(&file, body).unwrap();
    file
}

impl super::Env {
    /// What http_root serves to the node of the completion `ev`:
    /// `<http_root>/agent_images/<node>`.
    pub fn served_file(&self, ev: &Value) -> PathBuf {
        let node = ev["node_uuid"]
            .as_str()
            .unwrap_or_else(|| panic!("no node_uuid in the completion {ev}"));
        self.link_dir().join(node)
    }
}
