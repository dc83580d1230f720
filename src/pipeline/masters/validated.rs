//! `image_download_source = http`: the agent downloads an http(s) source
//! itself, and the worker answers the source's own URL, after a HEAD check
//! ([`pass_through`]) or, with `[conductor]conductor_always_validates_images`,
//! once it has downloaded, verified and inspected it (format declared and
//! permitted, qcow2 safety), as Ironic 39's conductor does in that mode
//! ([`validated`]). The verified bytes stay in the cache as a master of
//! their own (never converted, linked to no node, named by
//! [`master_name`]), so a repeated request does not download them again;
//! eviction treats them like any unlinked master. What is answered is
//! decided here, a pure function of what was found; `Masters` fetches and
//! obtains.

use crate::messages::Completion;
use crate::store::cache::{self, MasterMeta};
use crate::store::checksum::{Algo, Expected};

/// The master the validated bytes of `href` are kept as: never converted,
/// named as a prepare of the same source without `force_raw` names it.
pub(super) fn master_name(href: &str) -> String {
    cache::master_name(href, None, false)
}

/// What a pass-through answers: the source's own URL, the checksum the
/// request gave (when one did: MD5 as `image_checksum`, others as
/// `image_os_hash_*`), the size the source announced, never converted.
pub(super) fn pass_through(
    href: &str,
    expected: Option<Expected>,
    size: Option<u64>,
    done: &mut Completion,
) {
    done.image_url = Some(href.to_string());
    if let Some(e) = expected {
        answer_checksum(e, done);
    }
    done.image_size = size;
    done.converted = Some(false);
}

/// What a validated pass-through answers: the source's own URL, as
/// [`pass_through`] does, with the format detected in the verified bytes
/// (`meta`) and their size, and the SHA-256 of those very bytes when the
/// request gave no checksum (so the agent verifies it gets the bytes
/// inspected here).
pub(super) fn validated(
    href: &str,
    expected: Option<Expected>,
    meta: &MasterMeta,
    done: &mut Completion,
) {
    done.image_url = Some(href.to_string());
    match expected {
        Some(e) => answer_checksum(e, done),
        None => {
            done.image_os_hash_algo = Some("sha256".into());
            done.image_os_hash_value = Some(meta.sha256.clone());
        }
    }
    done.image_disk_format = Some(meta.source_format.name().into());
    done.image_size = Some(meta.size);
    done.converted = Some(false);
}

/// The request's own checksum, answered as Ironic takes it back.
fn answer_checksum(e: Expected, done: &mut Completion) {
    if e.algo == Algo::Md5 {
        done.image_checksum = Some(e.hex);
    } else {
        done.image_os_hash_algo = Some(e.algo.name().into());
        done.image_os_hash_value = Some(e.hex);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image_format::Format;
    use crate::messages::Action;

    const HREF: &str = "https://images.example/disk.qcow2";

    fn done() -> Completion {
        Completion::new(Action::Prepare, None, None, "me")
    }

    fn expected(algo: Algo, hex: &str) -> Expected {
        Expected {
            algo,
            hex: hex.into(),
        }
    }

    fn meta() -> MasterMeta {
        MasterMeta {
            source: HREF.into(),
            fetched_at: 1,
            source_last_modified: None,
            source_size: 10,
            source_md5: None,
            source_sha256: Some("aa11".into()),
            source_sha512: None,
            source_format: Format::Qcow2,
            converted: false,
            disk_format: Format::Qcow2.served(),
            size: 10,
            md5: None,
            sha256: "aa11".into(),
            sha512: None,
            inode: 1,
        }
    }

    /// An MD5 is answered as `image_checksum`, another algorithm as
    /// `image_os_hash_*`; without a checksum none is answered, and the
    /// size is the source's announcement.
    #[test]
    fn a_pass_through_answers_the_requests_checksum_and_the_url() {
        let mut md5 = done();
        pass_through(HREF, Some(expected(Algo::Md5, "m")), Some(7), &mut md5);
        assert_eq!(md5.image_url.as_deref(), Some(HREF));
        assert_eq!(md5.image_checksum.as_deref(), Some("m"));
        assert_eq!(md5.image_os_hash_algo, None);
        assert_eq!(md5.image_size, Some(7));
        assert_eq!(md5.converted, Some(false));
        let mut sha512 = done();
        pass_through(HREF, Some(expected(Algo::Sha512, "s")), None, &mut sha512);
        assert_eq!(sha512.image_checksum, None);
        assert_eq!(sha512.image_os_hash_algo.as_deref(), Some("sha512"));
        assert_eq!(sha512.image_os_hash_value.as_deref(), Some("s"));
        assert_eq!(sha512.image_size, None);
        let mut none = done();
        pass_through(HREF, None, None, &mut none);
        assert_eq!(
            (none.image_checksum, none.image_os_hash_value),
            (None, None)
        );
    }

    /// Validated bytes are answered with their detected format and size,
    /// and, without the request's checksum, their own SHA-256.
    #[test]
    fn a_validated_pass_through_answers_what_was_inspected() {
        let mut given = done();
        validated(
            HREF,
            Some(expected(Algo::Sha256, "cc")),
            &meta(),
            &mut given,
        );
        assert_eq!(given.image_os_hash_value.as_deref(), Some("cc"));
        assert_eq!(given.image_disk_format.as_deref(), Some("qcow2"));
        assert_eq!(given.image_size, Some(10));
        assert_eq!(given.converted, Some(false));
        let mut own = done();
        validated(HREF, None, &meta(), &mut own);
        assert_eq!(own.image_os_hash_algo.as_deref(), Some("sha256"));
        assert_eq!(own.image_os_hash_value.as_deref(), Some("aa11"));
        assert_eq!(own.image_url.as_deref(), Some(HREF));
    }
}
