"""The soak's own 3-node RabbitMQ cluster: nodes soak1..3@localhost on AMQP
ports 5781-5783 (distribution 25781-25783), a cookie, data, logs and an
empty plugins file of their own under the soak's directory. The default
node on 5672 is never touched; only these nodes are stopped, killed or
paused."""

import json
import re
import os
import signal
import subprocess
import time

CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
PORTS = (5781, 5782, 5783)


def node_name(i):
    return f"soak{i + 1}@localhost"


def url(i):
    return f"amqp://guest:guest@127.0.0.1:{PORTS[i]}/%2f"


class Cluster:
    """Three nodes, started, joined and driven through rabbitmqctl."""

    def __init__(self, home):
        self.home = home
        self.children = [None, None, None]
        self.beams = [None, None, None]
        os.makedirs(home, exist_ok=True)
        cookie = os.path.join(home, ".erlang.cookie")
        with open(cookie, "w") as f:
            f.write("IIWSOAKCLUSTERCOOKIE")
        os.chmod(cookie, 0o400)
        for i, port in enumerate(PORTS):
            n = self._dir(i)
            os.makedirs(n, exist_ok=True)
            with open(os.path.join(n, "enabled_plugins"), "w") as f:
                f.write("[].\n")
            # The nodes form the cluster as they boot (no stop_app / join_cluster
            # round, each rabbitmqctl call costs seconds on a loaded machine).
            peers = "".join(f"cluster_formation.classic_config.nodes.{k + 1} = {node_name(k)}\n"
                            for k in range(3))
            with open(os.path.join(n, "rabbitmq.conf"), "w") as f:
                f.write(f"listeners.tcp.default = {port}\nloopback_users = none\n"
                        f"cluster_formation.peer_discovery_backend = classic_config\n{peers}")

    def _dir(self, i):
        return os.path.join(self.home, f"n{i + 1}")

    def env(self, i):
        n = self._dir(i)
        return dict(os.environ, HOME=self.home, RABBITMQ_NODENAME=node_name(i),
                    RABBITMQ_NODE_PORT=str(PORTS[i]), RABBITMQ_DIST_PORT=str(25781 + i),
                    RABBITMQ_MNESIA_BASE=os.path.join(n, "mnesia"),
                    RABBITMQ_LOG_BASE=os.path.join(n, "log"),
                    RABBITMQ_ENABLED_PLUGINS_FILE=os.path.join(n, "enabled_plugins"),
                    RABBITMQ_CONFIG_FILE=os.path.join(n, "rabbitmq.conf"))

    def ctl(self, i, *args, check=True, timeout=120):
        """`rabbitmqctl -n <node i> ARGS`; its stdout."""
        out = subprocess.run([CTL, "-n", node_name(i), *args], env=self.env(i),
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl -n {node_name(i)} {args}: {out.stdout}{out.stderr}")
        return out.stdout

    def start(self):
        # The first node boots alone, the other two then find it and join.
        self.spawn(0)
        self.await_startup(0)
        for i in (1, 2):
            self.spawn(i)
        for i in (1, 2):
            self.await_startup(i)
        status = json.loads(self.ctl(0, "cluster_status", "--formatter", "json"))
        running = status.get("running_nodes", [])
        assert all(node_name(i) in running for i in range(3)), status

    def spawn(self, i):
        log = open(os.path.join(self.home, f"n{i + 1}.out"), "ab")
        # cwd: a node that crashes writes its erl_crash.dump beside its files.
        self.children[i] = subprocess.Popen([SERVER], env=self.env(i), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log, cwd=self._dir(i))
        log.close()

    def await_startup(self, i):
        deadline = time.monotonic() + 600   # a loaded machine boots a node slowly
        while True:
            try:
                out = subprocess.run([CTL, "-n", node_name(i), "-q", "await_startup", "--timeout", "60"],
                                     env=self.env(i), capture_output=True, timeout=90)
                if out.returncode == 0:
                    self.beams[i] = int(self.ctl(i, "eval", "os:getpid().").strip().strip('"'))
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node_name(i)} did not start; see {self.home}")
            time.sleep(0.5)

    def stop_app(self, i):
        self.ctl(i, "stop_app")

    def start_app(self, i):
        self.ctl(i, "start_app")
        self.ctl(i, "await_startup", "--timeout", "60")

    def kill9(self, i):
        os.kill(self.beams[i], signal.SIGKILL)
        self.beams[i] = None
        if self.children[i]:
            self.children[i].wait()
            self.children[i] = None

    def restart(self, i):
        """Starts node i again (unless its server is still booting) and waits for it."""
        if self.children[i] is None or self.children[i].poll() is not None:
            self.spawn(i)
        self.await_startup(i)

    def pause(self, i):
        os.kill(self.beams[i], signal.SIGSTOP)

    def resume(self, i):
        os.kill(self.beams[i], signal.SIGCONT)

    def connections(self, i):
        """(pid, name) of every connection the cluster lists, through node i."""
        out = self.ctl(i, "-q", "--no-table-headers", "list_connections", "pid", "client_properties",
                       timeout=30)
        conns = []
        for line in out.splitlines():
            pid, _, props = line.partition("\t")
            name = re.search(r'"connection_name","([^"]*)"', props)
            if pid.startswith("<"):
                conns.append((pid, name.group(1) if name else ""))
        return conns

    def close_connection(self, i, pid):
        self.ctl(i, "close_connection", pid, "soak fault", check=False, timeout=30)

    def stop_all(self):
        for i in range(3):
            if self.beams[i]:
                try:
                    os.kill(self.beams[i], signal.SIGCONT)
                except ProcessLookupError:
                    pass
            if self.children[i] is None:
                continue
            ok = subprocess.run([CTL, "-n", node_name(i), "stop"], env=self.env(i),
                                capture_output=True, timeout=120).returncode == 0
            if not ok and self.beams[i]:
                try:
                    os.kill(self.beams[i], signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.children[i].wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.children[i].kill()
            self.children[i] = None
