#!/usr/bin/env python3
"""Driver of bench/soak (run it through bench/soak, which builds the worker
and the Python environment): a 3-node RabbitMQ cluster of its own, two
workers on one host's queue and directories (with --peers N: N conductors
with [peers] on, the first with those two processes, the others one each),
a steady stream of prepare / deployed / cleanup commands for hundreds of
nodes, random faults every few seconds (with peers, an impostor without the
secret among them), and at the end the figures that must be zero.

    soak.py BIN [--minutes N] [--nodes N] [--window N] [--rate N] [--grace S] [--seed N] [--keep]
                [--peers N]

Why the figures are defined as they are: docs/benchmarks.md, "Soak".
"""

import argparse
import collections
import hashlib
import hmac
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import pika

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from soak_cluster import Cluster, url as node_url  # noqa: E402

EXCHANGE = "ironic-image-worker"
SLOW_RATE = 768 << 10       # bytes/s of the throttled source, per connection
FS_MIB = 1024               # the soak's own file system for the workers' directories
FS_PEER_MIB = 512           # more of it for each conductor after the first (--peers)
CACHE_MIB = 256             # [pxe]image_cache_size: small, so eviction runs
VARIANTS = 12               # ?v=N variants of each image: distinct masters, more misses
REISSUE_AFTER = 90          # seconds: an unconfirmed publish with no answer is sent again
PEERS_EXCHANGE = "ironic-image-worker.peers"
METRIC_PREFIX = "ironic_image_worker_"
# The workers' counters the figures sum over every process life.
COUNTED = tuple(METRIC_PREFIX + n for n in (
    "download_bytes_total", "peer_received_bytes_total", "peer_served_bytes_total",
    "peer_served_requests_total", "peer_queries_total", "peer_fetch_failures_total",
    "peer_refused_messages_total", "peer_refused_offers_total", "peer_silent_claims_total",
    "amqp_reconnects_total"))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def digests(path):
    md5, sha = hashlib.md5(), hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
            sha.update(chunk)
    return md5.hexdigest(), sha.hexdigest()


# ---------------------------------------------------------------- images

class Image:
    """A source image and the reference digests of what must be served."""

    def __init__(self, src_dir, name, lane, fmt):
        self.name, self.lane, self.fmt = name, lane, fmt
        self.path = os.path.join(src_dir, name)
        self.src_md5, self.src_sha256 = digests(self.path)
        if fmt == "qcow2":
            ref = self.path + ".ref.raw"
            run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", self.path, ref)
        else:
            ref = self.path
        self.ref_md5, self.ref_sha256 = digests(ref)
        self.ref_size = os.path.getsize(ref)
        if ref != self.path:
            os.unlink(ref)


def write_random(path, offset, mib, rng):
    with open(path, "r+b") as f:
        f.seek(offset << 20)
        f.write(rng.randbytes(mib << 20))


def make_images(src, rng):
    """Raw and qcow2 images made with qemu-img, some served slowly."""
    os.makedirs(src)

    def raw(name, virtual_mib, parts):
        path = os.path.join(src, name)
        run("qemu-img", "create", "-q", "-f", "raw", path, f"{virtual_mib}M")
        for offset, mib in parts:
            write_random(path, offset, mib, rng)
        return path

    raw("raw-a.img", 8, [(0, 8)])
    raw("raw-d.img", 6, [(0, 6)])
    for name, virtual, parts, compress in (("q-b.qcow2", 32, [(0, 8), (20, 4)], False),
                                           ("q-c.qcow2", 16, [(2, 6)], True),
                                           ("q-e.qcow2", 24, [(4, 8)], False)):
        base = raw(name + ".base", virtual, parts)
        run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", *(["-c"] if compress else []),
            base, os.path.join(src, name))
        os.unlink(base)
    return [Image(src, "raw-a.img", "fast", "raw"), Image(src, "q-b.qcow2", "fast", "qcow2"),
            Image(src, "q-c.qcow2", "fast", "qcow2"), Image(src, "raw-d.img", "slow", "raw"),
            Image(src, "q-e.qcow2", "slow", "qcow2")]


# ---------------------------------------------------------------- workers

class Workers:
    """The `serve` processes: `slots[i]` is the conductor (host) process i
    works for. Conductor 1 always has two processes on its queue and
    directories; with peers on, conductors 2..N one each."""

    def __init__(self, binary, configs, slots, work, peers):
        self.binary, self.configs, self.slots, self.work = binary, configs, slots, work
        n = len(slots)
        self.http = [free_port() for _ in range(n)]
        self.metrics = [free_port() for _ in range(n)]
        self.peer_ports = [free_port() for _ in range(n)] if peers else [None] * n
        self.procs = [None] * n
        # per slot: incarnations {pid, start, end, rss: [(t, kib)], counters: {series: value}}
        self.lives = [[] for _ in range(n)]
        self.lock = threading.Lock()

    def ports_of(self, conductor):
        """The image ports of a conductor's processes (they share http_root)."""
        return [self.http[i] for i, c in enumerate(self.slots) if c == conductor]

    def start(self, slot):
        order = [slot % 3, (slot + 1) % 3, (slot + 2) % 3]
        urls = ",".join(node_url(i) for i in order)
        logf = open(os.path.join(self.work, f"worker{slot + 1}.log"), "ab")
        extra = []
        if self.peer_ports[slot] is not None:
            extra = ["--set", f"peers.listen=127.0.0.1:{self.peer_ports[slot]}"]
        proc = subprocess.Popen(
            [self.binary, "--config", self.configs[self.slots[slot]],
             "--set", f"http.listen=127.0.0.1:{self.http[slot]}",
             "--set", f"metrics.listen=127.0.0.1:{self.metrics[slot]}",
             *extra,
             "--set", f"amqp.url={urls}", "serve"],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
            env=dict(os.environ, RUST_LOG="info,lapin=warn"))
        logf.close()
        with self.lock:
            self.procs[slot] = proc
            self.lives[slot].append({"pid": proc.pid, "start": time.monotonic(), "end": None, "rss": [],
                                     "counters": {}})
        self.wait_healthy(slot)

    def wait_healthy(self, slot):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.procs[slot] is not None and self.procs[slot].poll() is not None:
                raise RuntimeError(f"worker {slot + 1} exited ({self.procs[slot].returncode}); see {self.work}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[slot]}/healthz", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"worker {slot + 1} not healthy; see {self.work}")

    def kill9(self, slot):
        with self.lock:
            proc = self.procs[slot]
            self.procs[slot] = None
            self.lives[slot][-1]["end"] = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def sample(self):
        now = time.monotonic()
        with self.lock:
            for slot, proc in enumerate(self.procs):
                if proc is None:
                    continue
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        kib = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
                except (OSError, StopIteration):
                    continue
                self.lives[slot][-1]["rss"].append((now, kib))

    def scrape(self):
        """Keeps the last value of the counters summed in the figures, per
        process life (a killed process's last scrape stands for its life)."""
        for slot in range(len(self.procs)):
            with self.lock:
                proc, life = self.procs[slot], (self.lives[slot] or [None])[-1]
            if proc is None or life is None:
                continue
            counters = self.counters(slot)
            if counters is not None:
                with self.lock:
                    if self.procs[slot] is proc:
                        life["counters"] = counters

    def counters(self, slot):
        """Every series of COUNTED of one live process: {series: value}."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[slot]}/metrics",
                                          timeout=10).read().decode()
        except OSError:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith(COUNTED):
                series, _, value = line.rpartition(" ")
                try:
                    out[series[len(METRIC_PREFIX):]] = float(value)
                except ValueError:
                    pass
        return out

    def total(self, prefix, conductor=None):
        """A counter (all series starting with `prefix`) summed over every
        process life, or over the lives of one conductor's processes."""
        total = 0.0
        for slot, lives in enumerate(self.lives):
            if conductor is not None and self.slots[slot] != conductor:
                continue
            for life in lives:
                total += sum(v for k, v in life["counters"].items() if k.startswith(prefix))
        return total

    def series(self, prefix):
        """{series: value} of a counter, summed over every process life."""
        out = collections.Counter()
        for lives in self.lives:
            for life in lives:
                for k, v in life["counters"].items():
                    if k.startswith(prefix):
                        out[k[len(prefix):] or "total"] += v
        return out

    def metric(self, slot, name):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics[slot]}/metrics",
                                          timeout=10).read().decode()
        except OSError:
            return None
        total = None
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total = (total or 0) + float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.scrape()
        for slot, proc in enumerate(self.procs):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                self.lives[slot][-1]["end"] = time.monotonic()
                self.procs[slot] = None


# ---------------------------------------------------------------- AMQP

def params(urls):
    return [pika.URLParameters(u + "?heartbeat=5&connection_attempts=1&socket_timeout=5"
                               "&blocked_connection_timeout=30") for u in urls]


def connect(urls, name):
    """A blocking connection to the first node of `urls` that answers."""
    ps = params(urls)
    for p in ps:
        p.client_properties = {"connection_name": name}
    return pika.BlockingConnection(ps)


def declare_replies(ch, reply_queue):
    ch.queue_declare(reply_queue, durable=True, arguments={"x-queue-type": "quorum"})


class Publisher(threading.Thread):
    """Publishes commands with publisher confirms; reports each outcome."""

    def __init__(self, urls, reply_queue, events):
        super().__init__(daemon=True)
        self.urls, self.reply_queue, self.events = list(urls), reply_queue, events
        self.todo = queue.Queue()
        self.stopping = False

    def run(self):
        conn = ch = None
        while not self.stopping:
            try:
                if conn is None:
                    self.urls.append(self.urls.pop(0))
                    conn = connect(self.urls, "soak-publisher")
                    ch = conn.channel()
                    ch.confirm_delivery()
                    declare_replies(ch, self.reply_queue)
                try:
                    item = self.todo.get(timeout=0.2)
                except queue.Empty:
                    conn.process_data_events(0)
                    continue
                self.publish(ch, *item)
            except Exception:  # noqa: BLE001 - any connection failure: reconnect
                conn = ch = None
                time.sleep(0.5)

    def publish(self, ch, routing, body, corr):
        props = pika.BasicProperties(delivery_mode=2, reply_to=self.reply_queue,
                                     correlation_id=corr, content_type="application/json")
        try:
            ch.basic_publish(EXCHANGE, routing, body, properties=props, mandatory=True)
            self.events.put(("sent", corr))
        except pika.exceptions.UnroutableError:
            self.events.put(("unroutable", corr))
        except pika.exceptions.NackError:
            self.events.put(("nacked", corr))
        except Exception:
            self.events.put(("unconfirmed", corr))
            raise


class Consumer(threading.Thread):
    """Consumes the soak's quorum reply queue, acknowledging each reply
    after handing it on."""

    def __init__(self, urls, reply_queue, events):
        super().__init__(daemon=True)
        self.urls, self.reply_queue, self.events = list(urls), reply_queue, events
        self.stopping = False

    def run(self):
        while not self.stopping:
            try:
                self.urls.append(self.urls.pop(0))
                conn = connect(self.urls, "soak-consumer")
                ch = conn.channel()
                declare_replies(ch, self.reply_queue)
                ch.basic_qos(prefetch_count=500)
                for method, props, body in ch.consume(self.reply_queue, inactivity_timeout=0.2):
                    if self.stopping:
                        break
                    if method is None:
                        continue
                    self.events.put(("reply", props.correlation_id, method.redelivered, body))
                    ch.basic_ack(method.delivery_tag)
                conn.close()
            except Exception:  # noqa: BLE001 - any connection failure: reconnect
                time.sleep(0.5)


def drain_dead_letters(urls, dead_queue):
    """Every message of the dead-letter queue: (correlation id, reason)."""
    out = []
    conn = connect(urls, "soak-dead-letters")
    ch = conn.channel()
    while True:
        method, props, _body = ch.basic_get(dead_queue, auto_ack=True)
        if method is None:
            break
        deaths = (props.headers or {}).get("x-death") or [{}]
        reason = deaths[0].get("reason", "?")
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        out.append((props.correlation_id, reason))
    conn.close()
    return out


# ---------------------------------------------------------------- verification

def fetch(url):
    """GET url: (status, md5, sha256, bytes read, Content-Length)."""
    md5, sha = hashlib.md5(), hashlib.sha256()
    n = 0
    with urllib.request.urlopen(url, timeout=60) as r:
        length = int(r.headers.get("Content-Length", -1))
        while chunk := r.read(1 << 20):
            md5.update(chunk)
            sha.update(chunk)
            n += len(chunk)
        return r.status, md5.hexdigest(), sha.hexdigest(), n, length


def verify(completion, image, ports):
    """Downloads what image_url serves (from any process of the node's
    conductor: they share http_root) and checks it against the completion
    and the reference.
    Returns (outcome, detail): ok, wrong, missing or failed."""
    url = urllib.parse.urlsplit(completion["image_url"])
    order = [url.port] + [p for p in ports if p != url.port]
    deadline = time.monotonic() + 90
    last = ""
    while time.monotonic() < deadline:
        for port in order:
            try:
                _st, md5, sha, n, length = fetch(f"http://127.0.0.1:{port}{url.path}")
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return "missing", f"{url.path}: 404 from port {port}"
                last = f"HTTP {e.code}"
                continue
            except Exception as e:  # noqa: BLE001 - refused, reset, cut: another try
                last = repr(e)
                continue
            if n != length:
                last = f"short body {n}/{length}"
                continue
            want = (image.ref_md5, image.ref_sha256, image.ref_size)
            told = (completion.get("image_checksum"), completion.get("image_os_hash_value"),
                    completion.get("image_size"))
            if (md5, sha, n) == want and told == want:
                return "ok", ""
            return "wrong", f"{url.path} ({image.name}): served {(md5, sha, n)} told {told} ref {want}"
        time.sleep(1)
    return "failed", last


# ---------------------------------------------------------------- the stream of commands

class Command:
    """One published command and every answer it got."""

    def __init__(self, node, action, corr):
        self.node, self.action, self.corr = node, action, corr
        self.state = "queued"       # queued, sent, unconfirmed, unroutable, nacked
        self.queued_at = time.monotonic()
        self.answers = []
        self.answered_at = []


class Node:
    """One node's cycle: prepare, verify what is served, (deployed,) cleanup."""

    def __init__(self, conductor):
        self.uuid = str(uuid.uuid4())
        self.conductor = conductor   # the conductor (host) all its commands go to, as in Ironic
        self.pending = None          # the Command waiting for its answer
        self.phase = "idle"
        self.image = None
        self.next_at = 0.0
        self.cleaned = False         # the last command answered was a successful cleanup


class Stream:
    """Keeps `window` commands in flight over the nodes, one at a time per
    node (as Ironic sends them), and tallies the answers."""

    def __init__(self, soak, nodes, window, rate, rng):
        self.soak, self.window, self.rate, self.rng = soak, window, rate, rng
        self.credit, self.credit_at = 0.0, time.monotonic()
        self.nodes = [Node(i % len(soak.hosts)) for i in range(nodes)]
        self.by_uuid = {n.uuid: n for n in self.nodes}
        self.commands = {}
        self.events = queue.Queue()
        self.verifies = queue.Queue()
        self.in_verify = 0
        self.tally = collections.Counter()
        self.errors = collections.Counter()
        self.wrong = []
        self.not_served = []
        self.left_after_cleanup = []
        self.stale = []
        self.sources = set()        # image sources (hrefs) prepared: each a master of its own
        self.issuing = True
        self.verifier_threads = [threading.Thread(target=self.verifier, daemon=True) for _ in range(4)]
        self.verify_jobs = queue.Queue()
        for t in self.verifier_threads:
            t.start()

    def in_flight(self):
        return sum(1 for n in self.nodes if n.pending is not None) + self.in_verify

    def send(self, node, action, body):
        corr = str(uuid.uuid4())
        cmd = Command(node, action, corr)
        self.commands[corr] = cmd
        node.pending = cmd
        body = dict(body, action=action, node_uuid=node.uuid, request_id=corr)
        host = self.soak.hosts[node.conductor]
        self.soak.publisher.todo.put((f"{host}.node.{action}", json.dumps(body), corr))

    def prepare(self, node):
        image = self.rng.choice(self.soak.images)
        node.image = image
        source = f"{self.soak.source}/{image.lane}/{image.name}"
        if self.rng.random() < 0.4:
            source += f"?v={self.rng.randrange(VARIANTS)}"
        self.sources.add((source, image.name))
        info = {"image_source": source, "image_os_hash_algo": "sha256",
                "image_os_hash_value": image.src_sha256, "image_disk_format": image.fmt,
                "image_type": "whole-disk"}
        node.phase = "prepare"
        self.send(node, "prepare", {"instance_info": info})

    def tick(self):
        """One round: events in, next commands out."""
        self.drain_events()
        self.drain_verifies()
        self.reissue_unconfirmed()
        if not self.issuing:
            return
        now = time.monotonic()
        self.credit = min(self.rate, self.credit + (now - self.credit_at) * self.rate)
        self.credit_at = now
        room = min(int(self.credit), self.window - self.in_flight())
        if room <= 0:
            return
        idle = [n for n in self.nodes if n.pending is None and n.phase == "idle" and n.next_at <= now]
        self.rng.shuffle(idle)
        for node in idle[:room]:
            self.credit -= 1
            self.prepare(node)

    def drain_events(self):
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            if ev[0] == "reply":
                self.on_reply(*ev[1:])
            else:
                cmd = self.commands.get(ev[1])
                if cmd is not None:
                    cmd.state = ev[0]

    def on_reply(self, corr, redelivered, body):
        cmd = self.commands.get(corr)
        if cmd is None:
            self.tally["replies for unknown commands"] += 1
            return
        if redelivered and body in cmd.answers:
            # The consumer's own acknowledgement was lost with its connection.
            self.tally["reply redeliveries ignored"] += 1
            return
        cmd.answers.append(body)
        cmd.answered_at.append(time.monotonic())
        if len(cmd.answers) > 1:
            self.on_duplicate(cmd)
            return
        node = cmd.node
        if node.pending is not cmd:
            self.tally["answers after reissue"] += 1
            return
        node.pending = None
        self.advance(node, cmd, json.loads(body))

    def on_duplicate(self, cmd):
        node = cmd.node
        if cmd.action == "prepare" and node.cleaned:
            self.stale.append(f"{node.uuid}: a second answer to prepare {cmd.corr} after its cleanup")

    def advance(self, node, cmd, completion):
        ok = completion.get("status") == "success"
        if not ok:
            self.errors[f"{cmd.action}: {completion.get('error', {}).get('code')}"] += 1
        if cmd.action == "prepare":
            node.cleaned = False
            if ok and completion.get("image_url"):
                node.phase = "verify"
                self.in_verify += 1
                self.verify_jobs.put((node, completion))
            else:
                node.phase = "cleanup"
                self.send(node, "cleanup", {})
        elif cmd.action == "deployed":
            node.phase = "cleanup"
            self.send(node, "cleanup", {})
        else:
            node.phase = "idle"
            node.cleaned = ok
            node.next_at = time.monotonic() + self.rng.uniform(0, 3)
            if ok and self.soak.files_of(node):
                self.left_after_cleanup.append(f"{node.uuid}: {self.soak.files_of(node)}")

    def verifier(self):
        while True:
            node, completion = self.verify_jobs.get()
            outcome = verify(completion, node.image, self.soak.workers.ports_of(node.conductor))
            self.verifies.put((node, outcome))

    def drain_verifies(self):
        while True:
            try:
                node, (outcome, detail) = self.verifies.get_nowait()
            except queue.Empty:
                return
            self.in_verify -= 1
            self.tally[f"served images: {outcome}"] += 1
            if outcome == "wrong":
                self.wrong.append(detail)
            elif outcome != "ok":
                self.not_served.append(f"{outcome}: {detail}")
            action = "deployed" if self.rng.random() < 0.5 else "cleanup"
            node.phase = action
            self.send(node, action, {})

    def reissue_unconfirmed(self):
        now = time.monotonic()
        for node in self.nodes:
            cmd = node.pending
            if cmd and cmd.state in ("unconfirmed", "nacked", "unroutable") and not cmd.answers \
                    and now - cmd.queued_at > REISSUE_AFTER:
                self.tally["reissued after an unconfirmed publish"] += 1
                if cmd.action == "prepare":
                    node.pending = None
                    node.phase = "idle"
                else:
                    self.send(node, cmd.action, {})

    def settled(self):
        return self.in_verify == 0 and all(n.pending is None for n in self.nodes)


# ---------------------------------------------------------------- faults

class Faults(threading.Thread):
    """One fault at a time, every few seconds, each undone before the next.
    Worker 1 is never killed: it lives the whole run, so its RSS shows
    whether memory stays flat. With peers on, the impostor is among the
    faults (twice as likely as each other kind, and the first fault of the
    run, so that even a short run has one)."""

    KINDS = {"kill -9 worker": "fault_worker", "broker stop_app": "fault_stop_app",
             "broker kill -9": "fault_kill_beam", "broker SIGSTOP": "fault_sigstop",
             "close connections": "fault_connections", "disk full": "fault_full",
             "slow clients": "fault_clients", "impostor": "fault_impostor"}
    IMPOSTOR = "impostor"

    def __init__(self, soak, rng, until):
        super().__init__(daemon=True)
        self.soak, self.rng, self.until = soak, rng, until
        self.done = collections.Counter()
        self.failed = []
        self.undo = None
        only = soak.args.faults
        self.kinds = sorted(k for k in self.KINDS if k != self.IMPOSTOR and (not only or k in only))
        if soak.args.peers and (not only or self.IMPOSTOR in only):
            self.kinds += [self.IMPOSTOR] * 2

    def run(self):
        first = True
        while time.monotonic() < self.until:
            time.sleep(self.rng.uniform(2, 6))
            if time.monotonic() >= self.until:
                break
            kind = self.rng.choice(self.kinds)
            if first and self.IMPOSTOR in self.kinds:
                kind = self.IMPOSTOR
            first = False
            try:
                getattr(self, self.KINDS[kind])()
                self.done[kind] += 1
            except Exception as e:  # noqa: BLE001 - reported, the soak goes on
                self.failed.append(f"{kind}: {e!r}")
                log(f"fault {kind} failed: {e!r}")

    def hold(self, lo, hi, undo):
        """Waits lo..hi seconds, then undoes the fault (also if the soak ends)."""
        self.undo = undo
        end = time.monotonic() + self.rng.uniform(lo, hi)
        while time.monotonic() < min(end, self.until):
            time.sleep(0.2)
        self.undo = None
        undo()

    def fault_worker(self):
        workers = self.soak.workers
        slot = self.rng.randrange(1, len(workers.procs))
        if workers.procs[slot] is None:
            workers.start(slot)
        workers.kill9(slot)
        log(f"fault: kill -9 worker {slot + 1} (conductor {workers.slots[slot] + 1})")
        self.hold(1, 5, lambda: workers.start(slot))

    def fault_stop_app(self):
        c, i = self.soak.cluster, self.rng.randrange(3)
        c.stop_app(i)
        log(f"fault: stop_app node {i + 1}")
        self.hold(4, 12, lambda: c.start_app(i))

    def fault_kill_beam(self):
        c, i = self.soak.cluster, self.rng.randrange(3)
        c.kill9(i)
        log(f"fault: kill -9 beam of node {i + 1}")
        self.hold(2, 8, lambda: c.restart(i))

    def fault_sigstop(self):
        c, i = self.soak.cluster, self.rng.randrange(3)
        c.pause(i)
        log(f"fault: SIGSTOP node {i + 1}")
        self.hold(4, 15, lambda: c.resume(i))

    def fault_connections(self):
        c = self.soak.cluster
        conns = c.connections(self.rng.randrange(3))
        picked = self.rng.sample(conns, min(len(conns), self.rng.randint(1, 3)))
        for pid, _name in picked:
            c.close_connection(self.rng.randrange(3), pid)
        log(f"fault: closed connections {[name for _pid, name in picked]}")

    def fault_full(self):
        path = os.path.join(self.soak.fs, "fill")
        free = os.statvfs(self.soak.fs)
        size = free.f_bavail * free.f_frsize
        with open(path, "wb") as f:
            while size > 0:
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                    break
                except OSError:
                    size -= 1 << 20
        log(f"fault: disk full ({size >> 20} MiB filled)")
        self.hold(3, 10, lambda: os.unlink(path))

    def fault_clients(self):
        slot = self.rng.randrange(len(self.soak.workers.procs))
        count = self.rng.randint(200, 1500)
        secs = self.rng.uniform(4, 12)
        log(f"fault: {count} slow clients on worker {slot + 1} for {secs:.0f} s")
        subprocess.run([sys.executable, os.path.join(HERE, "soak_tools.py"), "flood",
                        str(self.soak.workers.http[slot]), str(count), str(secs)],
                       capture_output=True, timeout=secs + 120)

    def fault_impostor(self):
        """A client without the peers' secret, for 5-15 s (soak_tools.py
        impostor): forged offers naming its own listener, bad and replayed
        seals, squatted claims (LEAKED_CLAIMS of them under sealed names, as
        if leaked)."""
        soak = self.soak
        secs = self.rng.uniform(5, 15)
        # Every master is named `<uuid5>.converted` (whole-disk images, force_raw).
        names = sorted(n for n in soak.catalog if n.endswith(".converted"))
        leaked = [claim_queue(soak.secret, PEERS_EXCHANGE, n) for n in self.rng.sample(names, LEAKED_CLAIMS)]
        cfg = {"urls": soak.urls, "exchange": PEERS_EXCHANGE, "seconds": secs,
               "evil_url": soak.evil_url, "evil": soak.evil_facts, "catalog": soak.catalog,
               "leaked_claims": leaked, "heard_file": os.path.join(soak.work, "impostor-heard.json"),
               "seed": self.rng.randrange(1 << 30)}
        path = os.path.join(soak.work, "impostor.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        log(f"fault: impostor on the peers' exchange for {secs:.0f} s")
        out = subprocess.run([sys.executable, os.path.join(HERE, "soak_tools.py"), "impostor", path],
                             capture_output=True, text=True, timeout=secs + 180)
        if out.returncode != 0:
            raise RuntimeError(f"impostor exited {out.returncode}: {out.stderr.strip()[-400:]}")
        counts = json.loads(out.stdout.strip().splitlines()[-1])
        soak.impostor.update(counts)
        log(f"impostor: {counts}")


def claim_queue(secret, exchange, name):
    """The claim queue of master `name` as the workers name it (HMAC with
    the secret): what the impostor could only have from a leak."""
    tag = hmac.new(secret, b"iiw-peers-claim-v1\n" + name.encode(), hashlib.sha256).digest()[:16]
    return f"{exchange}.claim.{tag.hex()}"


# ---------------------------------------------------------------- the run

CONFIG = """[DEFAULT]
host = "{host}"
[deploy]
http_root = "{fs}/httpboot"
[pxe]
instance_master_path = "{fs}/master"
images_path = "{fs}/images"
image_cache_size = {cache}
[amqp]
heartbeat = 5
connect_timeout = 5
[cache]
clean_interval = 60
"""

# With --peers: every conductor's [peers], the same secret; each process's
# listener port comes with --set peers.listen.
PEERS = """[peers]
secret_file = "{secret_file}"
exchange = "{exchange}"
"""
EVIL_MIB = 4                # the impostor's own bytes
LEAKED_CLAIMS = 8           # claim queues the impostor squats under their sealed names, of 65 masters


class Soak:
    """Everything the soak starts, and its teardown."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.work = tempfile.mkdtemp(prefix="iiw-soak.", dir="/var/tmp")
        self.host = f"soak-{os.getpid()}"
        # One conductor (two processes on its queue) without peers; with
        # --peers N, N conductors, each its own host, queue and directories.
        if args.peers:
            self.hosts = [f"{self.host}-c{k + 1}" for k in range(args.peers)]
        else:
            self.hosts = [self.host]
        self.reply_queue = f"soak-replies-{self.host}"
        self.fs = os.path.join(self.work, "fs")
        self.urls = [node_url(i) for i in range(3)]
        self.mounted = False
        self.source_proc = self.evil_proc = None
        self.impostor = collections.Counter()
        self.catalog = {}
        self.cluster = None
        self.workers = None
        self.publisher = self.consumer = None
        self.stream = None

    def setup(self):
        img = os.path.join(self.work, "fs.img")
        with open(img, "wb") as f:
            f.truncate((FS_MIB + FS_PEER_MIB * max(0, len(self.hosts) - 1)) << 20)
        run("mkfs.ext4", "-q", "-F", "-m", "0", img)
        os.makedirs(self.fs)
        run("mount", "-o", "loop", img, self.fs)
        self.mounted = True
        log("making images with qemu-img")
        self.images = make_images(os.path.join(self.work, "src"), self.rng)
        port = free_port()
        self.source_proc = subprocess.Popen([sys.executable, os.path.join(HERE, "soak_tools.py"), "source",
                                             os.path.join(self.work, "src"), str(port), str(SLOW_RATE)])
        self.source = f"http://127.0.0.1:{port}"
        log("starting the 3-node cluster")
        self.cluster = Cluster(os.path.join(self.work, "cluster"))
        self.cluster.start()
        configs = []
        peers = ""
        if self.args.peers:
            peers = self.setup_peers()
        for k, host in enumerate(self.hosts):
            config = os.path.join(self.work, f"worker-c{k + 1}.toml" if self.args.peers else "worker.toml")
            with open(config, "w") as f:
                f.write(CONFIG.format(host=host, fs=self.dirs(k), cache=CACHE_MIB) + peers)
            configs.append(config)
        slots = [0] + list(range(len(self.hosts)))     # conductor 1 has two processes
        self.workers = Workers(self.args.binary, configs, slots, self.work, bool(self.args.peers))
        for slot in range(len(slots)):
            self.workers.start(slot)
        conn = connect(self.urls, "soak-setup")
        declare_replies(conn.channel(), self.reply_queue)
        conn.close()
        self.stream = Stream(self, self.args.nodes, self.args.window, self.args.rate, self.rng)
        self.publisher = Publisher(self.urls, self.reply_queue, self.stream.events)
        self.consumer = Consumer(self.urls[1:] + self.urls[:1], self.reply_queue, self.stream.events)
        self.publisher.start()
        self.consumer.start()

    def dirs(self, conductor):
        """The root of a conductor's directories on the soak's file system."""
        return os.path.join(self.fs, f"c{conductor + 1}") if self.args.peers else self.fs

    def setup_peers(self):
        """The secret, the impostor's listener and bytes, and the catalog of
        master names the impostor can compute (uuid5 of each image source
        the soak may prepare, as Ironic names masters): the [peers] section."""
        self.secret = f"soak-peers-{uuid.uuid4().hex}".encode()
        secret_file = os.path.join(self.work, "peers.secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, self.secret + b"\n")
        os.close(fd)
        evil_dir = os.path.join(self.work, "evil")
        os.makedirs(evil_dir)
        evil = os.path.join(evil_dir, "evil.raw")
        with open(evil, "wb") as f:
            f.write(self.rng.randbytes(EVIL_MIB << 20))
        md5, sha = digests(evil)
        self.evil_facts = {"size": os.path.getsize(evil), "md5": md5, "sha256": sha}
        self.evil_log = os.path.join(evil_dir, "requests.log")
        port = free_port()
        self.evil_proc = subprocess.Popen([sys.executable, os.path.join(HERE, "soak_tools.py"), "evil",
                                           evil, str(port), self.evil_log])
        self.evil_url = f"http://127.0.0.1:{port}"
        for image in self.images:
            base = f"{self.source}/{image.lane}/{image.name}"
            for href in [base] + [f"{base}?v={v}" for v in range(VARIANTS)]:
                name = str(uuid.uuid5(uuid.NAMESPACE_URL, href))
                facts = {"href": href, "sha256": image.src_sha256, "fmt": image.fmt}
                self.catalog[name] = self.catalog[name + ".converted"] = facts
        return PEERS.format(secret_file=secret_file, exchange=PEERS_EXCHANGE)

    def evil_requests(self):
        """The requests the impostor's listener got (a line each)."""
        if not self.args.peers or not os.path.exists(self.evil_log):
            return []
        with open(self.evil_log) as f:
            return f.read().splitlines()

    def source_stats(self):
        """What the source served: {path?query: {get, head, bytes}}."""
        try:
            return json.loads(urllib.request.urlopen(f"{self.source}/_stats", timeout=30).read())
        except OSError:
            return None

    def files_of(self, node):
        root = self.dirs(node.conductor)
        paths = (os.path.join(root, "images", node.uuid),
                 os.path.join(root, "httpboot", "agent_images", node.uuid))
        return [p for p in paths if os.path.lexists(p)]

    def run(self):
        start = time.monotonic()
        end = start + self.args.minutes * 60
        faults = Faults(self, self.rng, end)
        faults.start()
        sampling = threading.Event()
        threading.Thread(target=self.sampler, args=(sampling,), daemon=True).start()
        last = start
        while time.monotonic() < end:
            self.stream.tick()
            time.sleep(0.05)
            if time.monotonic() - last > 30:
                last = time.monotonic()
                log(f"{len(self.stream.commands)} commands, {self.stream.in_flight()} in flight, "
                    f"faults {dict(faults.done)}")
        log("end of the stream: undoing the last fault, then the grace period")
        self.stream.issuing = False
        faults.join()
        self.restore()
        grace_end = time.monotonic() + self.args.grace
        while not self.stream.settled() and time.monotonic() < grace_end:
            self.stream.tick()
            time.sleep(0.05)
        quiet = time.monotonic() + 15   # late duplicates
        while time.monotonic() < quiet:
            self.stream.tick()
            time.sleep(0.05)
        sampling.set()
        return faults, time.monotonic() - start

    def sampler(self, stop):
        n = 0
        while not stop.wait(2):
            self.workers.sample()
            n += 1
            if n % 3 == 0:
                self.workers.scrape()

    def restore(self):
        """Every broker node running, both workers up, the disk free."""
        fill = os.path.join(self.fs, "fill")
        if os.path.exists(fill):
            os.unlink(fill)
        c = self.cluster
        for i in range(3):
            if c.beams[i] is None:
                c.restart(i)
                continue
            c.resume(i)
            ok = subprocess.run([*("/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", f"soak{i + 1}@localhost"),
                                 "-q", "await_startup", "--timeout", "5"],
                                env=c.env(i), capture_output=True).returncode == 0
            if not ok:
                c.start_app(i)
        for slot, proc in enumerate(self.workers.procs):
            if proc is None:
                self.workers.start(slot)

    def teardown(self, keep):
        for t in (self.publisher, self.consumer):
            if t is not None:
                t.stopping = True
        if self.workers:
            self.workers.stop()
        for proc in (self.source_proc, self.evil_proc):
            if proc:
                proc.kill()
                proc.wait()
        if self.cluster:
            self.cluster.stop_all()
        if self.mounted:
            subprocess.run(["umount", self.fs])
        if keep:
            if os.path.exists(os.path.join(self.work, "fs.img")):
                os.unlink(os.path.join(self.work, "fs.img"))
            log(f"logs kept in {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


# ---------------------------------------------------------------- the figures

def rss_line(slot, life, run_secs):
    """Peak and final RSS of one worker process; flat when the peak of the
    second half of its life (after a warm-up quarter) is within 25% + 16 MiB
    of the first half's. Only judged for a process that lived 40% of the run."""
    samples = life["rss"]
    if not samples:
        return f"worker {slot + 1} pid {life['pid']}: no samples", True
    lived = (life["end"] or samples[-1][0]) - life["start"]
    peak, final = max(k for _t, k in samples) >> 10, samples[-1][1] >> 10
    text = f"worker {slot + 1} pid {life['pid']} ({lived / 60:.1f} min): peak RSS {peak} MiB, final {final} MiB"
    if lived < 0.4 * run_secs or len(samples) < 8:
        return text, True
    warm = samples[len(samples) // 4:]
    half = len(warm) // 2
    first, second = max(k for _t, k in warm[:half]) >> 10, max(k for _t, k in warm[half:]) >> 10
    flat = second <= 1.25 * first + 16
    return f"{text}; after warm-up, first half peak {first} MiB, second half {second} MiB: " \
           f"{'flat' if flat else 'GROWING'}", flat


def summary(soak, faults, run_secs):
    """Prints the figures; True when every must-be-zero figure is zero."""
    s = soak.stream
    cmds = list(s.commands.values())
    sent = [c for c in cmds if c.state == "sent"]
    soak.workers.scrape()
    dead = []
    for host in soak.hosts:
        try:
            dead += drain_dead_letters(soak.urls, f"ironic-image-worker.{host}.dead")
        except Exception as e:  # noqa: BLE001 - reported; every unanswered command then counts as lost
            print(f"dead-letter queue of {host} not read: {e!r}")
    dead_corr = collections.Counter(corr for corr, _r in dead)
    lost = [c for c in sent if not c.answers and c.corr not in dead_corr]
    unconfirmed = [c for c in cmds if c.state not in ("sent", "queued")]
    twice = [c for c in cmds if len(c.answers) > 1]
    left = [f"{n.uuid}: {soak.files_of(n)}" for n in s.nodes if n.cleaned and soak.files_of(n)]
    by_action = collections.Counter(c.action for c in sent)
    ok = not lost and not s.wrong and not left
    print("\n==== soak summary")
    print(f"run: {run_secs / 60:.1f} min ({soak.args.minutes} min of commands + grace), {len(s.nodes)} nodes, "
          f"{soak.args.window} in flight, {len(soak.images)} images x {VARIANTS} variants, seed {soak.args.seed}")
    shape = collections.Counter(soak.workers.slots)
    print(f"conductors: {len(soak.hosts)} ({', '.join(f'{h}: {shape[k]} process(es)' for k, h in enumerate(soak.hosts))}); "
          f"peers {'on' if soak.args.peers else 'off'}")
    print(f"faults: {dict(faults.done)}; failed to inject: {len(faults.failed)}")
    for f in faults.failed[:10]:
        print(f"  {f}")
    print(f"commands sent (confirmed by the broker): {len(sent)} {dict(by_action)}")
    print(f"publishes not confirmed (connection lost, nack or unroutable; not counted as sent): "
          f"{len(unconfirmed)}, of which answered {sum(1 for c in unconfirmed if c.answers)}")
    print(f"answered: {sum(1 for c in sent if c.answers)}; errors: {dict(s.errors)}")
    print(f"lost (sent, never answered, not dead-lettered): {len(lost)}  (must be 0)")
    for c in lost[:20]:
        print(f"  lost {c.action} {c.node.uuid} corr {c.corr}")
    print(f"answered twice: {len(twice)} ({dict(collections.Counter(c.action for c in twice))})")
    for c in twice[:5]:
        gaps = ", ".join(f"{t - c.answered_at[0]:.1f} s" for t in c.answered_at[1:])
        codes = [json.loads(b).get("status") for b in c.answers]
        first = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - c.answered_at[0])))
        print(f"  {c.action} {c.node.uuid} (corr {c.corr}): {len(c.answers)} answers {codes}, "
              f"first at {first}, later ones after {gaps}")
    print(f"dead-lettered: {len(dead)} {dict(collections.Counter(r for _c, r in dead))}, "
          f"of which answered anyway {sum(1 for c in cmds if c.corr in dead_corr and c.answers)}")
    print(f"served images verified: {s.tally['served images: ok']}; wrong bytes served: {len(s.wrong)}  (must be 0)")
    for w in s.wrong[:10]:
        print(f"  {w}")
    print(f"prepared images not served (404 before deployed/cleanup, or no download within 90 s): "
          f"{len(s.not_served)}")
    for w in s.not_served[:10]:
        print(f"  {w}")
    flat = True
    for slot in range(len(soak.workers.lives)):
        for life in soak.workers.lives[slot]:
            text, f = rss_line(slot, life, run_secs)
            flat &= f
            print(text)
    print(f"files left for nodes that were cleaned up: {len(left)}  (must be 0)")
    for line in (left + s.left_after_cleanup)[:10]:
        print(f"  {line}")
    print(f"files present right after a cleanup's answer: {len(s.left_after_cleanup)}; "
          f"stale prepare answers after a cleanup: {len(s.stale)}")
    for line in s.stale[:5]:
        print(f"  {line}")
    print(f"other: {dict((k, v) for k, v in s.tally.items() if not k.startswith('served'))}")
    for slot in range(len(soak.workers.procs)):
        print(f"worker {slot + 1} metrics: reconnects "
              f"{soak.workers.metric(slot, 'ironic_image_worker_amqp_reconnects_total')}")
    ratio = source_figures(soak)
    impostor_ok, evil_gets, forged = True, 0, 0
    if soak.args.peers:
        impostor_ok, evil_gets, forged = peer_figures(soak)
    ok = ok and flat and impostor_ok
    print(f"RESULT sent={len(sent)} answered={sum(1 for c in sent if c.answers)} lost={len(lost)} "
          f"twice={len(twice)} dead={len(dead)} wrong_bytes={len(s.wrong)} files_left={len(left)} "
          f"rss_flat={flat} conductors={len(soak.hosts)} source_per_master={ratio} "
          f"peer_bytes={soak.workers.total('peer_received_bytes_total') / MIB:.0f}MiB "
          f"forged={forged} impostor_gets={evil_gets} {'PASS' if ok else 'FAIL'}")
    return ok


MIB = float(1 << 20)


def source_figures(soak):
    """Bytes the source served against the sizes of the distinct image
    sources prepared (each a master): how many times a master crossed from
    its source on average. Returns that ratio (text)."""
    stats = soak.source_stats()
    if stats is None:
        print("source: statistics not read")
        return "?"
    prepared = {}
    for href, name in soak.stream.sources:
        prepared[href[len(soak.source):]] = os.path.getsize(os.path.join(soak.work, "src", name))
    gets = sum(v["get"] for v in stats.values())
    sent = sum(v["bytes"] for v in stats.values())
    size = sum(prepared.values())
    per = [stats.get(p, {}).get("get", 0) for p in prepared]
    ratio = f"{sent / size:.2f}" if size else "0"
    print(f"source: {gets} GETs, {sum(v['head'] for v in stats.values())} HEADs, {sent / MIB:.0f} MiB sent, for "
          f"{len(prepared)} distinct image sources prepared ({size / MIB:.0f} MiB): {ratio} times each "
          f"master's bytes (GETs per source: mean {sum(per) / max(1, len(per)):.1f}, max {max(per, default=0)})")
    w = soak.workers
    for k, host in enumerate(soak.hosts):
        print(f"  conductor {k + 1} ({host}): {w.total('download_bytes_total', k) / MIB:.0f} MiB from sources, "
              f"{w.total('peer_received_bytes_total', k) / MIB:.0f} MiB from peers")
    return ratio


def peer_figures(soak):
    """The peers' counters summed over every process life, and what the
    impostor did and got. Returns (ok, impostor listener requests, forged
    messages sent)."""
    w = soak.workers
    print(f"peers (summed over every process life; a killed process counts to its last scrape): "
          f"{w.total('peer_received_bytes_total') / MIB:.0f} MiB received, "
          f"{w.total('peer_served_bytes_total') / MIB:.0f} MiB served, "
          f"transfers served {dict(w.series('peer_served_requests_total'))}")
    print(f"  queries {dict(w.series('peer_queries_total'))}; fetch failures "
          f"{dict(w.series('peer_fetch_failures_total'))}; silent claims "
          f"{w.total('peer_silent_claims_total'):.0f}")
    print(f"  refused messages {dict(w.series('peer_refused_messages_total'))}; refused offers "
          f"{dict(w.series('peer_refused_offers_total'))}")
    imp = soak.impostor
    forged = sum(v for k, v in imp.items() if k.startswith(("offers", "downloading", "queries replayed",
                                                           "stale", "unsigned")))
    print(f"impostor: {forged} forged or replayed messages sent; {dict(imp)}")
    requests = soak.evil_requests()
    answers = imp.get("answers to the impostor", 0)
    print(f"impostor's listener asked for bytes: {len(requests)}  (must be 0); "
          f"answers to the impostor's queries: {answers}  (must be 0)")
    for line in requests[:10]:
        print(f"  {line}")
    return not requests and not answers, len(requests), forged


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary")
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--window", type=int, default=24, help="commands in flight at most")
    ap.add_argument("--rate", type=float, default=3, help="new node cycles (prepares) per second at most")
    ap.add_argument("--grace", type=float, default=240, help="seconds after the end for the last answers")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--keep", action="store_true", help="keep the logs even when the soak passes")
    ap.add_argument("--faults", type=lambda v: [k.strip() for k in v.split(",") if k.strip()], default=[],
                    help="only these kinds of fault, comma-separated (default: all), to chase one: "
                         + ", ".join(sorted(Faults.KINDS)))
    ap.add_argument("--peers", type=int, default=0,
                    help="N conductors with [peers] on, and the impostor among the faults (0: peers off, "
                         "one conductor)")
    args = ap.parse_args()
    unknown = set(args.faults) - set(Faults.KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    soak = Soak(args)
    ok = False
    try:
        soak.setup()
        log(f"soak of {args.minutes} min, seed {args.seed}, work dir {soak.work}")
        faults, secs = soak.run()
        ok = summary(soak, faults, secs)
    finally:
        soak.teardown(keep=args.keep or not ok)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
