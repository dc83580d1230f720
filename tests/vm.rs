//! Real machines deployed by a real Ironic 39 through `direct-worker`,
//! booted from a real ironic-python-agent 13 ramdisk (built once per recipe
//! by tests/vm/build-ramdisk, cached under /var/tmp) and deployed with this
//! worker binary; each machine's disk is compared with `qemu-img convert -O
//! raw` of the source (tests/vm/deploy.py runs each scenario and says what
//! it checks). Over RabbitMQ, over JSON-RPC and through stock `direct` (the
//! control: a broken harness is told apart from a broken worker) the Metal3
//! way: each node on Ironic's `redfish` hardware type (redfish power and
//! management, `redfish-virtual-media` boot) behind sushy-tools' Redfish
//! emulator and its libvirt driver, Ironic powering on a libvirt domain that
//! boots the ISO Ironic builds (tests/vm/redfish.py). The other scenarios
//! (TLS, Basic auth and gzip; OCI then a rebuild; the worker killed) on
//! fake-hardware, with a VM the harness starts itself. Its own test binary:
//! each VM keeps a core busy under TCG (where /dev/kvm is not ordinary KVM)
//! for a minute or more, which the many short tests of `it` should not
//! share, and at most [`VMS_AT_ONCE`] run at a time.
//!
//! Needs root (the ramdisk's build), qemu-system-x86, socat, mmdebstrap,
//! cpio, RabbitMQ on 127.0.0.1:5672, the Ironic virtualenv of the other
//! tests, and for Redfish: libvirtd and virtlogd running (qemu.conf with
//! `seccomp_sandbox = 0` and QEMU as root), virsh, Debian's python3-libvirt
//! (tests/vm/sushy-venv makes sushy-tools' virtualenv with it), SeaBIOS,
//! isolinux, syslinux-common and genisoimage; `.ci/run` installs and starts
//! them.

#[path = "it/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use common::plugin::plugin_python;
use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The ramdisk's directory (`vmlinuz`, `initramfs`), built when its recipe
/// changed; `IIW_VM_RAMDISK_CACHE` moves the cache.
fn ramdisk() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/build-ramdisk");
    let mut cmd = std::process::Command::new(script);
    if let Some(cache) = std::env::var_os("IIW_VM_RAMDISK_CACHE") {
        cmd.arg(cache);
    }
    let started = Instant::now();
    let out = cmd.stderr(std::process::Stdio::inherit()).output().unwrap();
    assert!(out.status.success(), "tests/vm/build-ramdisk failed");
    println!("ramdisk ready in {:.1?}", started.elapsed());
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    prune_other_recipes(&dir);
    dir
}

/// Bounds the cache: ramdisks of other recipes (about 400 MB each) go once
/// unused for a day (another checkout on the machine may still use one).
fn prune_other_recipes(current: &Path) {
    // Marks the current one as used (its modification time).
    if let Ok(dir) = std::fs::File::open(current) {
        let _ = dir.set_modified(std::time::SystemTime::now());
    }
    let Ok(entries) = std::fs::read_dir(current.parent().unwrap()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > Duration::from_secs(86_400));
        let name = entry.file_name();
        if path != current && path.is_dir() && !name.to_string_lossy().starts_with('.') && stale {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// sushy-tools' virtualenv (tests/vm/sushy-venv makes it once);
/// `IIW_SUSHY_VENV` moves it.
fn sushy_venv() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/sushy-venv");
    let mut cmd = std::process::Command::new(script);
    if let Some(venv) = std::env::var_os("IIW_SUSHY_VENV") {
        cmd.arg(venv);
    }
    let out = cmd.stderr(std::process::Stdio::inherit()).output().unwrap();
    assert!(out.status.success(), "tests/vm/sushy-venv failed");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Machines booting at once: on a 2-core machine under TCG, more than
/// three slow every boot towards the agent's and Ironic's timeouts, and
/// finish no sooner.
const VMS_AT_ONCE: usize = 3;

/// A turn among the [`VMS_AT_ONCE`] machines, given back when dropped.
struct Turn;

static RUNNING: std::sync::Mutex<usize> = std::sync::Mutex::new(0);
static FREED: std::sync::Condvar = std::sync::Condvar::new();

impl Turn {
    fn take() -> Turn {
        let mut running = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
        while *running >= VMS_AT_ONCE {
            running = FREED.wait(running).unwrap_or_else(|p| p.into_inner());
        }
        *running += 1;
        Turn
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        *RUNNING.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        FREED.notify_one();
    }
}

/// Runs tests/vm/deploy.py for `scenario` (with `extra` arguments) in its
/// turn and returns its output; fails with that output when the scenario
/// fails.
fn deploy(scenario: &str, extra: &[&str]) -> String {
    let ramdisk = ramdisk();
    let sushy = sushy_venv();
    let python = plugin_python();
    let _turn = Turn::take();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/deploy.py");
    let mut child = std::process::Command::new(python)
        .arg(script)
        .args(["--worker", BIN, "--ramdisk"])
        .arg(&ramdisk)
        .args(extra)
        .arg(scenario)
        .env_remove("IRONIC_IMAGE_WORKER_CONFIG")
        .env("IIW_SUSHY_VENV", &sushy)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The harness's own timeouts end it first; this is the last resort.
    let deadline = Instant::now() + Duration::from_secs(1200);
    let mut terminated = false;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline + Duration::from_secs(60) {
            child.kill().unwrap();
        } else if Instant::now() > deadline && !terminated {
            // SIGTERM first: the harness stops its Ironic, worker and VMs.
            terminated = true;
            let _ = std::process::Command::new("kill")
                .arg(child.id().to_string())
                .status();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success() && text.contains("1 passed, 0 failed"),
        "the {scenario} VM deploy failed (the harness's output is above)"
    );
    text
}

/// Then undeployed with automated cleaning (the agent boots again and
/// erases the disk's metadata) back to `available`.
#[test]
fn amqp_deploy_of_a_real_vm_then_undeploy_with_cleaning() {
    let text = deploy("amqp", &["--boot", "redfish", "--undeploy"]);
    assert!(text.contains("only the worker fetched the source"));
    assert!(text.contains("undeployed and cleaned back to available"));
}

#[test]
fn json_rpc_deploy_of_a_real_vm_without_a_broker() {
    let text = deploy("json-rpc", &["--boot", "redfish"]);
    assert!(text.contains("only the worker fetched the source"));
}

/// Stock Ironic `direct` on the same harness: the control.
#[test]
fn stock_direct_deploy_of_a_real_vm() {
    let text = deploy("direct", &["--boot", "redfish"]);
    assert!(text.contains("direct: Ironic fetched the source"));
}

/// The image port with TLS, HTTP Basic and `[http] gzip = "static"`: the
/// agent verifies the worker's certificate with the CA of its own `cafile`
/// option, authenticates with what Ironic hands it, and streams the
/// compressed image to disk through its decoder.
#[test]
fn gzip_over_tls_with_basic_auth_to_a_real_agent() {
    let text = deploy("gzip-tls", &[]);
    assert!(text.contains("only the worker fetched the source"));
    assert!(text.contains("gzip-tls: the agent got the image over TLS and Basic auth, compressed"));
}

/// An `oci://` image from a local registry (htpasswd, the node's pull
/// secret): only the worker pulls it. Then the machine is rebuilt with an
/// http(s) image (the agent boots again and writes it; the OCI image's
/// master stays cached).
#[test]
fn oci_image_deployed_to_a_real_vm_then_rebuilt_with_another() {
    let text = deploy("oci", &["--rebuild"]);
    assert!(text.contains("oci: the worker pulled the image from the registry"));
    assert!(text.contains("oci: rebuilt with another image"));
}

/// The worker killed (SIGKILL) in the middle of its download while the VM
/// boots, then started again: the broker hands the command to the new
/// process and the deploy completes.
#[test]
fn worker_killed_while_the_vm_boots() {
    let text = deploy("worker-killed", &[]);
    assert!(text.contains("worker-killed: the deploy completed"));
}
