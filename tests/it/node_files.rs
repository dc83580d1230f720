//! Node files left behind and shared with Ironic: files of nodes no command
//! asked for within `[cache]node_files_ttl` (a conductor takeover) are
//! removed by the periodic clean-up, only what the worker made and never
//! while the node is locked; the directories shared with Ironic let another
//! Unix user remove the worker's node files and publish its own symlinks.

use crate::common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// Sets the mtime of `path` itself (a symlink is not followed) to two hours
/// ago, as if nobody had touched it since.
fn age(path: &Path) {
    let then = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 7200;
    let out = std::process::Command::new("touch")
        .args(["-h", "-d", &format!("@{then}")])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until `ironic_image_worker_node_files_expired_total` reads `n`.
async fn wait_expired(worker: &Worker, n: f64) {
    let sample = "ironic_image_worker_node_files_expired_total";
    worker
        .wait_metrics(sample, |t| metric(t, sample) == Some(n))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_no_command_asked_for_expire_only_ours_and_never_locked() {
    let env = Env::new("[cache]\nclean_interval = 1\nnode_files_ttl = 3600\n");
    random_file(&env.root().join("allowed/a.img"), 1 << 20, 7);
    let url = format!("file://{}/allowed/a.img", env.root().display());
    let [stale, locked, fresh, asked_again, ironics] = [node(), node(), node(), node(), node()];
    for n in [&stale, &locked, &fresh, &asked_again] {
        let (ok, ev) = env.prepare(n, &url, &[]).await;
        assert!(ok, "{ev}");
    }
    let (images, links) = (env.images_dir(), env.link_dir());
    // Ironic's own file in a node directory of the worker's.
    std::fs::write(images.join(&stale).join("ironic-file"), b"Ironic's").unwrap();
    // Ironic's node: its own `disk` and its own symlink to it.
    std::fs::create_dir(images.join(&ironics)).unwrap();
    std::fs::write(images.join(&ironics).join("disk"), b"not a master").unwrap();
    std::os::unix::fs::symlink(images.join(&ironics).join("disk"), links.join(&ironics)).unwrap();
    for n in [&stale, &locked, &asked_again, &ironics] {
        age(&images.join(n));
        age(&links.join(n));
    }
    // Asked for again (a cache hit): that counts as asked for now.
    let (ok, ev) = env.prepare(&asked_again, &url, &[]).await;
    assert!(ok && ev["cache"] == "hit", "{ev}");
    // A command for `locked` is running (its node lock is held).
    let lock = std::fs::File::create(images.join(format!(".locks/{locked}.lock"))).unwrap();
    lock.lock().unwrap();

    let worker = env.serve().await;
    wait_expired(&worker, 1.0).await;
    assert!(
        links.join(&stale).symlink_metadata().is_err(),
        "symlink stays"
    );
    assert!(
        !images.join(&stale).join("disk").exists(),
        "hard link stays"
    );
    assert!(
        images.join(&stale).join("ironic-file").exists(),
        "Ironic's file removed"
    );
    for n in [&locked, &fresh, &asked_again] {
        assert!(images.join(n).join("disk").exists(), "{n}: disk removed");
        assert!(links.join(n).exists(), "{n}: symlink removed");
    }
    assert!(images.join(&ironics).join("disk").exists());
    assert!(links.join(&ironics).symlink_metadata().is_ok());

    // The command is over: the next clean-up removes the node's files, its
    // then empty directory and its lock file.
    drop(lock);
    wait_expired(&worker, 2.0).await;
    assert!(links.join(&locked).symlink_metadata().is_err());
    assert!(!images.join(&locked).exists(), "empty node directory stays");
    assert!(!images.join(format!(".locks/{locked}.lock")).exists());
    assert!(images.join(&fresh).join("disk").exists());
    assert_eq!(env.masters().len(), 1, "the master is still linked");
    worker.terminate().await;
}

/// Runs `cmd` as the Unix user `user` (its own group and its supplementary
/// groups).
fn as_user(user: &str, cmd: &[&str]) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args(["--reuid", user, "--regid", user, "--init-groups"])
        .args(cmd)
        .output()
        .unwrap()
}

/// Makes `group` and the system users `users` in it, if absent.
fn ensure_users(group: &str, users: &[&str]) {
    let run = |cmd: &str, args: &[&str]| {
        let out = std::process::Command::new(cmd).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run("groupadd", &["-f", group]);
    for user in users {
        let exists = std::process::Command::new("id")
            .arg(user)
            .output()
            .unwrap()
            .status
            .success();
        if !exists {
            run(
                "useradd",
                &[
                    "--system",
                    "--user-group",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    user,
                ],
            );
        }
        run("usermod", &["-aG", group, user]);
    }
}

fn chown(path: &Path, spec: &str) {
    let out = std::process::Command::new("chown")
        .arg(spec)
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_removes_node_files_and_links_in_shared_dirs() {
    assert!(
        rustix::process::geteuid().is_root(),
        "this test makes Unix users: run it as root (as CI does)"
    );
    let (group, worker_user, ironic_user) = ("iiw-shared", "iiw-worker", "iiw-ironic");
    ensure_users(group, &[worker_user, ironic_user]);
    let env = Env::new("[cache]\nshared_group = \"iiw-shared\"\nshared_dir_mode = \"2775\"\n");
    let root = env.root();
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).unwrap();
    random_file(&root.join("allowed/a.img"), 1 << 20, 3);
    // The worker's own master directory; Ironic's images_path and
    // http_root (set up as operations.md says); the symlink directory is
    // not there yet: the worker makes it first.
    std::fs::create_dir(env.master_dir()).unwrap();
    chown(&env.master_dir(), worker_user);
    for dir in [env.images_dir(), root.join("httpboot")] {
        std::fs::create_dir(&dir).unwrap();
        chown(&dir, &format!("{ironic_user}:{group}"));
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o2775)).unwrap();
    }
    // The binary where the other user can run it.
    let bin = root.join("ironic-image-worker");
    std::fs::copy(BIN, &bin).unwrap();
    let n = node();
    let url = format!("file://{}/allowed/a.img", root.display());
    let (bin, config) = (bin.to_str().unwrap(), env.config.to_str().unwrap());
    let out = as_user(
        worker_user,
        &[
            bin,
            "--config",
            config,
            "prepare",
            "--node",
            &n,
            "--image-source",
            &url,
        ],
    );
    let (ok, ev) = completion_of(&out);
    assert!(ok, "{ev} {}", String::from_utf8_lossy(&out.stderr));

    let gid = std::fs::metadata(root.join("httpboot")).unwrap().gid();
    for dir in [env.link_dir(), env.images_dir().join(&n)] {
        let m = std::fs::metadata(&dir).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o2775, "{}", dir.display());
        assert_eq!(m.gid(), gid, "{}: group", dir.display());
    }
    let disk = env.images_dir().join(&n).join("disk");
    assert_eq!(std::fs::metadata(&disk).unwrap().mode() & 0o044, 0o044);
    // Ironic, as its own user: its own symlink in the directory the worker
    // made, then the worker's node files removed as its cleanup does.
    let theirs = env.link_dir().join(node());
    let link = env.link_dir().join(&n);
    let node_dir = env.images_dir().join(&n);
    for cmd in [
        vec!["ln", "-s", disk.to_str().unwrap(), theirs.to_str().unwrap()],
        vec!["rm", link.to_str().unwrap(), theirs.to_str().unwrap()],
        vec!["rm", "-r", node_dir.to_str().unwrap()],
    ] {
        let out = as_user(ironic_user, &cmd);
        assert!(
            out.status.success(),
            "{cmd:?} as {ironic_user}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(!node_dir.exists() && link.symlink_metadata().is_err());
}
