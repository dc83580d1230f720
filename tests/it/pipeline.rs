//! The core pipeline through the one-shot CLI and the embedded image server:
//! real HTTP and file sources, real images, md5sum/sha256sum as references.

use crate::common;

use common::*;
use serde_json::Value;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_image_is_cached_hashed_linked_and_served() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 5 * 1024 * 1024 + 123, 1);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let node = node();

    let (ok, ev) = env
        .prepare(
            &node,
            &server.url("disk.img"),
            &["--checksum", &md5sum(&src)],
        )
        .await;
    assert!(ok, "{ev}");
    assert_served(&ev, &src);
    assert_eq!(ev["image_disk_format"], "raw");
    assert_eq!(ev["cache"], "miss");
    let url = format!("http://127.0.0.1:{}/agent_images/{node}", env.http_port);
    assert_eq!(ev["image_url"], url);
    assert_served(&ev, &fetch_served(&ev, env.root()).await);

    // Ironic's layout: symlink -> <images>/<node>/disk, a hard link of the master.
    let disk = env.images_dir().join(&node).join("disk");
    assert_eq!(
        std::fs::read_link(env.link_dir().join(&node)).unwrap(),
        disk
    );
    let masters = env.masters();
    assert_eq!(masters.len(), 1, "{masters:?}");
    assert!(
        masters[0].ends_with(".converted"),
        "force_raw applies to a whole-disk image"
    );
    let master = env.master_dir().join(&masters[0]);
    assert_eq!(
        std::fs::metadata(&master).unwrap().ino(),
        std::fs::metadata(&disk).unwrap().ino()
    );

    // The same event again: same answer, no second request of any kind.
    let (ok, again) = env.prepare(&node, &server.url("disk.img"), &[]).await;
    assert!(ok);
    assert_eq!(again["cache"], "hit");
    for key in [
        "image_url",
        "image_checksum",
        "image_os_hash_value",
        "image_size",
    ] {
        assert_eq!(again[key], ev[key], "{key}");
    }
    assert_eq!(server.count("GET", "disk.img"), 1);
    assert_eq!(server.count("HEAD", "disk.img"), 0);

    // Another node, no checksum: Ironic's revalidation (HEAD) but no download.
    let other = common::node();
    let (ok, third) = env.prepare(&other, &server.url("disk.img"), &[]).await;
    assert!(ok, "{third}");
    assert_eq!(third["cache"], "hit");
    assert_eq!(third["image_checksum"], ev["image_checksum"]);
    assert_eq!(server.count("GET", "disk.img"), 1);
    assert_eq!(server.count("HEAD", "disk.img"), 1);

    // The source changes (newer Last-Modified): the next prepare downloads again.
    random_file(&src, 1024 * 1024, 2);
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&src)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let (ok, fresh) = env
        .prepare(&common::node(), &server.url("disk.img"), &[])
        .await;
    assert!(ok, "{fresh}");
    assert_eq!(fresh["cache"], "miss");
    assert_served(&fresh, &src);
    assert_eq!(server.count("GET", "disk.img"), 2);
    // The first node still gets the bytes announced to it.
    assert_served(&ev, &fetch_served(&ev, env.root()).await);
    assert!(env.temporaries().is_empty());
    worker.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_server_ranges_head_and_path_safety() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1024 * 1024, 3);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let node = node();
    let (ok, _) = env.prepare(&node, &server.url("disk.img"), &[]).await;
    assert!(ok);
    let data = std::fs::read(&src).unwrap();
    let client = reqwest::Client::new();
    let url = worker.image_url(&format!("/agent_images/{node}"));

    let r = client
        .get(&url)
        .header("Range", "bytes=100-199")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes 100-199/{}", data.len())
    );
    assert_eq!(r.bytes().await.unwrap().as_ref(), &data[100..200]);

    let r = client.head(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-length"], data.len().to_string());
    assert!(r.headers().contains_key("last-modified"));

    let r = client.post(&url).send().await.unwrap();
    assert_eq!(r.status(), 405);

    // A symlink planted in http_root pointing outside the worker's directories.
    let secret = env.root().join("secret.txt");
    std::fs::write(&secret, "secret").unwrap();
    std::os::unix::fs::symlink(&secret, env.link_dir().join("evil")).unwrap();
    assert_eq!(get(&worker.image_url("/agent_images/evil")).await.0, 403);
    // Escapes, plain and encoded, and directory listings.
    for path in [
        "/agent_images/../../secret.txt",
        "/agent_images/%2e%2e/%2e%2e/secret.txt",
        "/agent_images/..%2f..%2fsecret.txt",
        "/agent_images/%00",
    ] {
        let status = get(&worker.image_url(path)).await.0;
        assert!(status == 404 || status == 400, "{path}: {status}");
    }
    assert_eq!(get(&worker.image_url("/agent_images/")).await.0, 404);
    assert_eq!(get(&worker.image_url("/agent_images")).await.0, 403);
    assert_eq!(get(&worker.image_url("/")).await.0, 404);
    worker.terminate().await;
}

/// A 2 MiB source `disk.img` served over HTTP, for a failing prepare.
async fn failing_source(env: &Env) -> SourceServer {
    random_file(&env.root().join("src/disk.img"), 2 * 1024 * 1024, 4);
    SourceServer::start(&env.root().join("src")).await
}

/// A failed prepare of `node` left nothing: no master, no temporary, no
/// link, no lock file (they stay only for masters and nodes that exist).
fn assert_nothing_left(env: &Env, node: &str) {
    assert!(env.masters().is_empty(), "{:?}", env.masters());
    assert!(env.temporaries().is_empty());
    assert!(!env.link_dir().join(node).exists());
    for dir in [env.master_dir(), env.images_dir()] {
        let locks: Vec<_> = std::fs::read_dir(dir.join(".locks"))
            .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(locks.is_empty(), "{}: {locks:?}", dir.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_leaves_nothing_in_the_cache() {
    let env = Env::new("");
    let server = failing_source(&env).await;
    let node = node();
    let wrong = "0".repeat(64);
    let (ok, ev) = env
        .prepare(
            &node,
            &server.url("disk.img"),
            &["--os-hash-algo", "sha256", "--os-hash-value", &wrong],
        )
        .await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "checksum_mismatch");
    assert!(ev.get("image_url").is_none());
    assert_nothing_left(&env, &node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_source_leaves_nothing_in_the_cache() {
    let env = Env::new("");
    let server = failing_source(&env).await;
    let node = node();
    let (_, ev) = env.prepare(&node, &server.url("missing.img"), &[]).await;
    assert_eq!(ev["error"]["code"], "source_not_found");
    assert_nothing_left(&env, &node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_source_leaves_nothing_in_the_cache() {
    let env = Env::new("");
    let node = node();
    let refused = format!("http://127.0.0.1:{}/disk.img", free_port());
    let (_, ev) = env.prepare(&node, &refused, &[]).await;
    assert_eq!(ev["error"]["code"], "source_unreachable", "{ev}");
    assert_nothing_left(&env, &node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_node_uuid_leaves_nothing_in_the_cache() {
    let env = Env::new("");
    let server = failing_source(&env).await;
    let (_, ev) = env.prepare("../../etc", &server.url("disk.img"), &[]).await;
    assert_eq!(ev["error"]["code"], "invalid_node_uuid");
    assert_nothing_left(&env, "../../etc");
}

/// An allowed directory holding `disk.img`, and a file outside it.
fn file_sources(env: &Env) -> (std::path::PathBuf, std::path::PathBuf) {
    let allowed = env.root().join("allowed");
    random_file(&allowed.join("disk.img"), 1024 * 1024 + 7, 5);
    let outside = env.root().join("src/outside.img");
    random_file(&outside, 1024, 6);
    (allowed, outside)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_under_the_allowed_paths_is_served() {
    let env = Env::new("");
    let (allowed, _) = file_sources(&env);
    let img = allowed.join("disk.img");
    let (ok, ev) = env
        .prepare(&node(), &format!("file://{}", img.display()), &[])
        .await;
    assert!(ok, "{ev}");
    assert_served(&ev, &img);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_source_outside_the_allowed_paths_is_refused() {
    let env = Env::new("");
    let (_, outside) = file_sources(&env);
    let (_, ev) = env
        .prepare(&node(), &format!("file://{}", outside.display()), &[])
        .await;
    assert_eq!(ev["error"]["code"], "source_not_allowed");
}

/// `..` and symlinks are resolved before the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_dot_and_symlinks_out_of_the_allowed_paths_are_refused() {
    let env = Env::new("");
    let (allowed, outside) = file_sources(&env);
    let sneaky = format!("file://{}/../src/outside.img", allowed.display());
    let (_, ev) = env.prepare(&node(), &sneaky, &[]).await;
    assert_eq!(ev["error"]["code"], "source_not_allowed", "..: {ev}");
    std::os::unix::fs::symlink(&outside, allowed.join("link.img")).unwrap();
    let link = format!("file://{}/link.img", allowed.display());
    let (_, ev) = env.prepare(&node(), &link, &[]).await;
    assert_eq!(ev["error"]["code"], "source_not_allowed", "symlink: {ev}");
}

/// `/dev/zero` is refused; even where /dev is allowed, a device, a FIFO or
/// a directory is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_regular_files_are_file_sources() {
    let env = Env::new("");
    let (allowed, _) = file_sources(&env);
    let (_, ev) = env.prepare(&node(), "file:///dev/zero", &[]).await;
    assert_eq!(ev["error"]["code"], "source_not_allowed");
    let fifo = allowed.join("fifo");
    tool("mkfifo", &[fifo.to_str().unwrap()]);
    let all = format!(
        "conductor.file_url_allowed_paths=/dev,{}",
        allowed.display()
    );
    for src in [
        "file:///dev/zero".to_string(),
        format!("file://{}", fifo.display()),
        format!("file://{}", allowed.display()),
    ] {
        let (ok, ev) = env.prepare(&node(), &src, &["--set", &all]).await;
        assert!(!ok);
        assert_eq!(ev["error"]["code"], "source_not_allowed", "{src}");
    }
}

/// A 3 MiB source `disk.img` beside a `SHA256SUMS` naming it (and another
/// file), served over HTTP, with its sha256 and sha512.
struct Checksummed {
    env: Env,
    src: std::path::PathBuf,
    sha: String,
    sha512: String,
    server: SourceServer,
}

impl Checksummed {
    async fn start() -> Checksummed {
        let env = Env::new("");
        let src = env.root().join("src/disk.img");
        random_file(&src, 3 * 1024 * 1024, 7);
        let sha = sha256sum(&src);
        std::fs::write(
            env.root().join("src/SHA256SUMS"),
            format!("{}  other.img\n{sha}  disk.img\n", "1".repeat(64)),
        )
        .unwrap();
        let server = SourceServer::start(&env.root().join("src")).await;
        let sha512 = sha512sum(&src);
        Checksummed {
            env,
            src,
            sha,
            sha512,
            server,
        }
    }

    /// A prepare of `disk.img` with `args`: its success or failure and
    /// its completion.
    async fn prepare(&self, args: &[&str]) -> (bool, Value) {
        let url = self.server.url("disk.img");
        self.env.prepare(&node(), &url, args).await
    }
}

/// A prepare of `c`'s `disk.img` with `args`, which must succeed.
async fn accepted(c: &Checksummed, args: &[&str]) -> Value {
    let (ok, ev) = c.prepare(args).await;
    assert!(ok, "{args:?}: {ev}");
    ev
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_with_an_algorithm_prefix() {
    let c = Checksummed::start().await;
    let ev = accepted(&c, &["--checksum", &format!("sha256:{}", c.sha)]).await;
    assert_served(&ev, &c.src);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_file_url() {
    let c = Checksummed::start().await;
    let ev = accepted(&c, &["--checksum", &c.server.url("SHA256SUMS")]).await;
    assert_served(&ev, &c.src);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn os_hash_sha512_is_answered_with_the_sha512() {
    let c = Checksummed::start().await;
    let sha512 = ["--os-hash-algo", "sha512", "--os-hash-value", &c.sha512];
    served(&c.src).sha512().check(&accepted(&c, &sha512).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn os_hash_wins_over_a_wrong_legacy_checksum() {
    let c = Checksummed::start().await;
    let wrong = "0".repeat(32);
    let sha = ["--os-hash-algo", "sha256", "--os-hash-value", &c.sha];
    let ev = accepted(&c, &[&["--checksum", &wrong][..], &sha].concat()).await;
    assert_served(&ev, &c.src);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksum_file_that_disagrees_is_a_mismatch() {
    let c = Checksummed::start().await;
    let bad = format!("{}  disk.img\n", "2".repeat(64));
    std::fs::write(c.env.root().join("src/BAD"), bad).unwrap();
    let (ok, ev) = c.prepare(&["--checksum", &c.server.url("BAD")]).await;
    assert!(!ok);
    assert_eq!(ev["error"]["code"], "checksum_mismatch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deployed_cleanup_and_relinking_are_idempotent() {
    let env = Env::new("");
    let a = env.root().join("src/a.img");
    let b = env.root().join("src/b.img");
    random_file(&a, 1024 * 1024, 8);
    random_file(&b, 1024 * 1024, 9);
    let server = SourceServer::start(&env.root().join("src")).await;
    let worker = env.serve().await;
    let node = node();
    let url = worker.image_url(&format!("/agent_images/{node}"));

    // Nothing prepared yet: both succeed and change nothing.
    for action in ["deployed", "cleanup"] {
        let (ok, ev) = env.oneshot(&[action, "--node", &node]).await;
        assert!(ok, "{ev}");
        assert!(!env.images_dir().join(&node).exists());
    }

    let (ok, _) = env.prepare(&node, &server.url("a.img"), &[]).await;
    assert!(ok);
    // A rebuild with another image replaces the node's link.
    let (ok, ev) = env.prepare(&node, &server.url("b.img"), &[]).await;
    assert!(ok);
    assert_served(&ev, &b);
    let (_, body) = get(&url).await;
    assert_eq!(body, std::fs::read(&b).unwrap());

    let (ok, _) = env.oneshot(&["deployed", "--node", &node]).await;
    assert!(ok);
    assert_eq!(get(&url).await.0, 404);
    assert!(!env.images_dir().join(&node).join("disk").exists());
    let (ok, _) = env.oneshot(&["deployed", "--node", &node]).await;
    assert!(ok);

    let (ok, _) = env.prepare(&node, &server.url("a.img"), &[]).await;
    assert!(ok);
    assert_eq!(get(&url).await.0, 200);
    let (ok, _) = env.oneshot(&["cleanup", "--node", &node]).await;
    assert!(ok);
    assert_eq!(get(&url).await.0, 404);
    assert!(!env.images_dir().join(&node).exists());
    // Masters stay cached for other nodes.
    assert_eq!(env.masters().len(), 2);
    worker.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_world_readable_under_umask_077() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1024 * 1024, 10);
    let server = SourceServer::start(&env.root().join("src")).await;
    let node = node();
    let out = env
        .run_with_umask(
            Some("077"),
            &[
                "prepare",
                "--node",
                &node,
                "--image-source",
                &server.url("disk.img"),
            ],
        )
        .await;
    let (ok, ev) = completion_of(&out);
    assert!(ok, "{ev}");
    let mode = |p: std::path::PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let master = env.master_dir().join(&env.masters()[0]);
    assert_eq!(mode(master), 0o644);
    assert_eq!(mode(env.images_dir().join(&node).join("disk")), 0o644);
    for dir in [
        env.master_dir(),
        env.images_dir(),
        env.images_dir().join(&node),
        env.link_dir(),
    ] {
        assert_eq!(mode(dir.clone()), 0o755, "{}", dir.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qcow2_kept_when_force_raw_does_not_apply() {
    let env = Env::new("");
    let raw = env.root().join("raw.img");
    random_file(&raw, 2 * 1024 * 1024, 11);
    let qcow = env.root().join("src/disk.qcow2");
    qcow2_from(&raw, &qcow, &[]);
    let server = SourceServer::start(&env.root().join("src")).await;

    for extra in [
        vec!["--force-raw", "false"],
        vec!["--image-type", "partition"],
        vec!["--stream-raw", "false"],
    ] {
        let (ok, ev) = env
            .prepare(&node(), &server.url("disk.qcow2"), &extra)
            .await;
        assert!(ok, "{extra:?}: {ev}");
        assert_eq!(ev["image_disk_format"], "qcow2");
        assert_eq!(ev["converted"], false);
        served(&qcow).context(format!("{extra:?}")).check(&ev);
    }
    // One unconverted master (plain name), shared by the three requests.
    assert_eq!(env.masters().len(), 1);
    assert!(!env.masters()[0].ends_with(".converted"));

    let (_, ev) = env
        .prepare(
            &node(),
            &server.url("disk.qcow2"),
            &["--disk-format", "raw", "--force-raw", "false"],
        )
        .await;
    assert_eq!(ev["error"]["code"], "format_mismatch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_source_modes() {
    let env = Env::new("");
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 12);
    let server = SourceServer::start(&env.root().join("src")).await;
    let md5 = md5sum(&src);
    // Ironic's `http` mode: an http(s) source is handed to the agent as is,
    // after a HEAD check, with the checksum it was given; nothing cached.
    let (ok, ev) = env
        .prepare(
            &node(),
            &server.url("disk.img"),
            &["--image-download-source", "http", "--checksum", &md5],
        )
        .await;
    assert!(ok, "{ev}");
    assert_eq!(ev["image_url"], server.url("disk.img"));
    assert_eq!(ev["image_checksum"], md5);
    assert_eq!(server.count("HEAD", "disk.img"), 1);
    assert_eq!(server.count("GET", "disk.img"), 0);
    assert!(env.masters().is_empty());
    let (_, ev) = env
        .prepare(
            &node(),
            &server.url("missing.img"),
            &["--image-download-source", "http"],
        )
        .await;
    assert_eq!(ev["error"]["code"], "source_not_found");
    // file:// sources are still cached and served in `http` mode.
    let local = env.root().join("allowed/disk.img");
    std::fs::copy(&src, &local).unwrap();
    let (ok, ev) = env
        .prepare(
            &node(),
            &format!("file://{}", local.display()),
            &["--image-download-source", "http"],
        )
        .await;
    assert!(ok, "{ev}");
    assert!(ev["image_url"].as_str().unwrap().contains("/agent_images/"));
    // swift is not the worker's business.
    let (_, ev) = env
        .prepare(
            &node(),
            &server.url("disk.img"),
            &["--image-download-source", "swift"],
        )
        .await;
    assert_eq!(ev["error"]["code"], "source_not_allowed");
}
