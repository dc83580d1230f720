//! Addresses no connection of the worker may reach, made real: a network
//! namespace of the test's own (`ip netns`, needs root as CI has) joined to
//! this one by a veth pair, holding a link-local address routed to it, and
//! a listener there (`tests/helpers/trap_server.py`) that logs every
//! request it gets. A loopback trap is the same listener on 127.0.0.1 in
//! this namespace. Everything is removed when dropped.

use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// A listening trap: where it listens and the requests it logged.
pub struct Trap {
    /// `http://<address>:<port>`.
    pub url: String,
    child: std::process::Child,
    log: PathBuf,
    ns: Option<Namespace>,
}

/// A namespace of the test's own and the route to its address.
struct Namespace {
    name: String,
    addr: String,
}

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {} (network namespaces need root, as CI has)",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Namespace {
    /// A namespace holding the link-local address `169.254.<a>.<b>`
    /// (random: never the metadata service's), routed from here over a
    /// veth pair on a private /30.
    fn new() -> Namespace {
        let n: u32 = rand_u16() as u32;
        let (a, b) = (1 + n % 250, 1 + (n / 250) % 250);
        let name = format!("iiw-trap-{n}");
        let (host_if, ns_if) = (format!("iiwh{n}"), format!("iiwn{n}"));
        let (x, y) = (n % 250, (n / 250) % 60 * 4);
        let (here, there) = (
            format!("10.231.{x}.{}", y + 1),
            format!("10.231.{x}.{}", y + 2),
        );
        let addr = format!("169.254.{a}.{b}");
        ip(&["netns", "add", &name]);
        let ns = Namespace { name, addr };
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if,
        ]);
        ip(&["link", "set", &ns_if, "netns", &ns.name]);
        ip(&["addr", "add", &format!("{here}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["link", "set", "lo", "up"]);
        inside(&["addr", "add", &format!("{there}/30"), "dev", &ns_if]);
        inside(&["addr", "add", &format!("{}/32", ns.addr), "dev", "lo"]);
        inside(&["link", "set", &ns_if, "up"]);
        inside(&["route", "add", "default", "via", &here]);
        ip(&["route", "add", &format!("{}/32", ns.addr), "via", &there]);
        ns
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["route", "del", &format!("{}/32", self.addr)])
            .status();
        // Deleting the namespace deletes its end of the veth pair, and so
        // the pair.
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn rand_u16() -> u16 {
    (uuid::Uuid::new_v4().as_u128() & 0xffff) as u16
}

impl Trap {
    /// A trap on a link-local address in a namespace of its own.
    pub fn link_local(dir: &Path) -> Trap {
        let ns = Namespace::new();
        let addr = ns.addr.clone();
        Trap::start(dir, &addr, 80, Some(ns))
    }

    /// A trap on 127.0.0.1 (a port of its own) in this namespace.
    pub fn loopback(dir: &Path) -> Trap {
        Trap::start(dir, "127.0.0.1", super::free_port(), None)
    }

    fn start(dir: &Path, addr: &str, port: u16, ns: Option<Namespace>) -> Trap {
        std::fs::create_dir_all(dir).unwrap();
        let log = dir.join(format!("trap-{addr}-{port}.jsonl"));
        std::fs::write(&log, "").unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/trap_server.py");
        let mut cmd = match &ns {
            Some(ns) => {
                let mut c = std::process::Command::new("ip");
                c.args(["netns", "exec", &ns.name, "python3"]);
                c
            }
            None => std::process::Command::new("python3"),
        };
        let mut child = cmd
            .arg(script)
            .args([addr, &port.to_string(), log.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        assert_eq!(first.trim(), "ready", "the trap did not start");
        Trap {
            url: format!("http://{addr}:{port}"),
            child,
            log,
            ns,
        }
    }

    /// Forgets the requests logged so far.
    pub fn clear(&self) {
        std::fs::write(&self.log, "").unwrap();
    }

    /// The requests it got so far.
    pub fn hits(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Trap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        drop(self.ns.take());
    }
}
