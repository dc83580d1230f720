//! RabbitMQ nodes of a test's own (a node name, ports, cookie and data in a
//! temporary directory), for the tests that must stop, kill or tune a
//! broker: the default node on 5672 is never touched.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `rabbitmqctl`, as the Debian package installs it.
pub const CTL: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";
/// `rabbitmq-server`, as the Debian package installs it.
pub const SERVER: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

/// Writes `cookie` as the Erlang cookie of the nodes whose `HOME` is `home`.
pub fn write_cookie(home: &Path, cookie: &str) {
    use std::os::unix::fs::PermissionsExt;
    let file = home.join(".erlang.cookie");
    std::fs::write(&file, cookie).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o400)).unwrap();
}

/// One node: its files in `dir`, `HOME` (and so the cookie) in `home`.
pub struct OwnNode {
    /// `name@localhost`.
    pub name: String,
    /// The AMQP port.
    pub port: u16,
    dist_port: u16,
    home: PathBuf,
    dir: PathBuf,
    child: Option<Child>,
}

impl OwnNode {
    /// Writes the files of node `name` in `dir`: `conf` as its
    /// `rabbitmq.conf` (after the listener on `port`, guest allowed from
    /// anywhere), no plugins, and the consumer timeout checked every second
    /// instead of every minute. Not started yet: see [`OwnNode::spawn`].
    pub fn new(home: &Path, dir: &Path, name: &str, ports: (u16, u16), conf: &str) -> OwnNode {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        let (port, dist_port) = ports;
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.default = {port}\nloopback_users = none\n{conf}"),
        )
        .unwrap();
        std::fs::write(
            dir.join("advanced.config"),
            "[{rabbit, [{channel_tick_interval, 1000}]}].\n",
        )
        .unwrap();
        OwnNode {
            name: name.to_string(),
            port,
            dist_port,
            home: home.to_path_buf(),
            dir: dir.to_path_buf(),
            child: None,
        }
    }

    /// The node's environment for `rabbitmq-server` and `rabbitmqctl`.
    pub fn env(&self, cmd: &mut Command) {
        let dir = &self.dir;
        cmd.env("HOME", &self.home)
            .env("RABBITMQ_NODENAME", &self.name)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            // Schedulers that sleep when out of work instead of spinning:
            // the tests' nodes share two cores with everything else.
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "+sbwt none +sbwtdcpu none +sbwtdio none",
            );
    }

    /// Starts the node (fresh, or again after a stop or a kill) and waits
    /// until it runs.
    pub fn start(&mut self) {
        self.spawn();
        self.await_startup();
    }

    /// Starts the node's server, its output in `<dir>/node.out`.
    pub fn spawn(&mut self) {
        assert!(
            Path::new(SERVER).exists(),
            "{SERVER} missing: install rabbitmq-server"
        );
        let log = std::fs::File::create(self.dir.join("node.out")).unwrap();
        let mut cmd = Command::new(SERVER);
        self.env(&mut cmd);
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.child = Some(cmd.spawn().expect("rabbitmq-server"));
    }

    /// Waits until the node runs its application. Its AMQP port is watched
    /// first: each `rabbitmqctl` starts an Erlang VM (most of a CPU second),
    /// and one asked before the node exists only fails.
    pub fn await_startup(&self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "node {} never listened on {}; see {}",
                self.name,
                self.port,
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        loop {
            let mut cmd = Command::new(CTL);
            self.env(&mut cmd);
            let args = ["-n", &self.name, "-q", "await_startup", "--timeout", "60"];
            if cmd.args(args).output().is_ok_and(|o| o.status.success()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not start; see {}",
                self.name,
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// `rabbitmqctl -n <node> ARGS`, which must succeed; its stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(CTL);
        self.env(&mut cmd);
        let out = cmd.arg("-n").arg(&self.name).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "rabbitmqctl -n {} {args:?}: {}{} (see {})",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.dir.display()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The node's AMQP URL (guest).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Stops the node cleanly (`rabbitmqctl stop`) and reaps it.
    pub fn stop(&mut self) {
        self.ctl(&["stop"]);
        self.reap();
    }

    /// Reaps the server script once the node is gone (killed).
    pub fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

impl Drop for OwnNode {
    /// Stops a node still running; kills its server script if it cannot.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let mut cmd = Command::new(CTL);
            self.env(&mut cmd);
            let stopped = cmd
                .args(["-n", &self.name, "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !stopped {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}
