#!/usr/bin/env python3
"""Helper processes of bench/soak, each run as a process of its own so that
the driver's threads do not share its interpreter:

    soak_tools.py source DIR PORT SLOW_RATE   the image source: /fast/NAME at
        full speed, /slow/NAME throttled to SLOW_RATE bytes/s per
        connection (query strings ignored, so ?v=N names another master)
    soak_tools.py flood PORT COUNT SECONDS    COUNT slow clients against an
        image server: half request headers, and requests never read
    soak_tools.py evil FILE PORT LOG           the impostor's listener: FILE's
        bytes for any GET or HEAD, each request logged (a line) to LOG
    soak_tools.py impostor CONFIG              the impostor on the peers'
        exchange, for a few seconds (see impostor() below); prints its
        counts as JSON

The source counts what it serves: GET /_stats answers
{"path?query": {"get": N, "head": N, "bytes": N}}.
"""

import hashlib
import hmac
import http.server
import json
import os
import random
import resource
import socket
import sys
import threading
import time


class Source(http.server.BaseHTTPRequestHandler):
    """GET/HEAD of a file under the served directory, maybe throttled."""

    protocol_version = "HTTP/1.1"
    root = "."
    slow_rate = 1 << 20
    stats = {}
    stats_lock = threading.Lock()

    def log_message(self, fmt, *args):
        pass

    def _count(self, what, n=1):
        with self.stats_lock:
            entry = self.stats.setdefault(self.path, {"get": 0, "head": 0, "bytes": 0})
            entry[what] += n

    def _stats(self):
        with self.stats_lock:
            body = json.dumps(self.stats).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def _file(self):
        path = self.path.split("?", 1)[0]
        parts = path.strip("/").split("/")
        if len(parts) != 2 or parts[0] not in ("fast", "slow") or parts[1].startswith("."):
            return None, None
        full = os.path.join(self.root, parts[1])
        return (full if os.path.isfile(full) else None), parts[0] == "slow"

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        if self.path == "/_stats":
            self._stats()
            return
        self._answer(body=True)

    def _answer(self, body):
        full, slow = self._file()
        if full is not None:
            self._count("get" if body else "head")
        if full is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(full)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            try:
                self._send(full, slow)
            except (BrokenPipeError, ConnectionResetError):
                pass   # the worker gave the download up (disk full, killed)

    def _send(self, full, slow):
        chunk = 64 << 10
        started = time.monotonic()
        sent = 0
        with open(full, "rb") as f:
            while True:
                data = f.read(chunk)
                if not data:
                    return
                self.wfile.write(data)
                sent += len(data)
                self._count("bytes", len(data))
                if slow:
                    ahead = sent / self.slow_rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)


def serve(handler, port):
    """Serves `handler` on 127.0.0.1:`port`, a thread per connection, forever."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.serve_forever()


def source(root, port, slow_rate):
    Source.root = root
    Source.slow_rate = slow_rate
    serve(Source, port)


def flood(port, count, seconds):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 256)), hard))
    held = []
    for k in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if k % 4 == 3:
                # A whole request whose answer is never read.
                s.sendall(b"GET /agent_images/00000000-0000-4000-8000-000000000000 HTTP/1.1\r\n"
                          b"Host: soak\r\n\r\n")
            else:
                s.sendall(b"GET /agent_images/x HTTP/1.1\r\nHost: slow\r\n")
            held.append(s)
        except OSError:
            pass
    time.sleep(seconds)
    for s in held:
        s.close()
    print(len(held))


class Evil(Source):
    """The impostor's listener: the same bytes of its own for any path. A
    worker asks it only if it took a forged offer; every request is logged."""

    file = None
    log = None

    def _file(self):
        with open(self.log, "a") as f:
            f.write(f"{time.time():.3f} {self.command} {self.path}\n")
        return self.file, False

    def do_GET(self):
        self._answer(body=True)   # any path, /_stats too, is the impostor's file


def evil(path, port, log):
    Evil.file, Evil.log = path, log
    open(log, "a").close()
    serve(Evil, port)


def sealed_headers(key, kind, correlation, reply_to, body, time_ms=None):
    """The seal headers of a peers' message (docs/contract.md, Peers), made
    with `key`: never the deployment's secret here, which the impostor does
    not have."""
    time_ms = time_ms if time_ms is not None else int(time.time() * 1000)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for field in (b"iiw-peers-v1", kind.encode(), correlation.encode(), reply_to.encode(),
                  str(time_ms).encode(), body):
        mac.update(len(field).to_bytes(8, "big"))
        mac.update(field)
    return {"x-iiw-peer-time": time_ms, "x-iiw-peer-mac": mac.hexdigest()}


def impostor(config_path):
    """A client of the soak's broker without the peers' secret, for
    `seconds`: it takes claim queues under the names it can compute (and
    the leaked sealed names it is given), replays sealed queries it heard in
    an earlier run (stale by now), asks unsigned queries of its own, and
    answers every query it hears on `query.#` with forged offers naming its
    own listener and bytes (unsigned, with a made-up seal, sealed with
    another key, `downloading`, and with the query's own seal copied), then
    replays that query as it was (a replay) and towards its own inbox (the
    seal then no longer holds). Counts what it sent, and every message that
    reached its inbox (an answer to it: must be none)."""
    import pika

    with open(config_path) as f:
        cfg = json.load(f)
    rng = random.Random(cfg["seed"])
    wrong_key = b"not-the-deployment-secret-" + rng.randbytes(8).hex().encode()
    exchange, catalog, evil_facts = cfg["exchange"], cfg["catalog"], cfg["evil"]
    counts = {k: 0 for k in ("queries heard", "offers unsigned", "offers made-up seal",
                             "offers sealed with another key", "downloading offers sealed with another key",
                             "offers with the query's seal copied", "queries replayed as heard",
                             "queries replayed to its own inbox", "stale queries replayed",
                             "unsigned queries", "claims squatted (unsealed names)",
                             "leaked sealed claims squatted", "leaked sealed claims already held",
                             "answers to the impostor")}
    ps = [pika.URLParameters(u + "?heartbeat=5&connection_attempts=1&socket_timeout=5") for u in cfg["urls"]]
    rng.shuffle(ps)
    for p in ps:
        p.client_properties = {"connection_name": "soak-impostor"}
    conn = pika.BlockingConnection(ps)
    ch = conn.channel()
    ch.exchange_declare(exchange, "topic", durable=True)
    heard_q = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
    ch.queue_bind(heard_q, exchange, "query.#")
    inbox = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
    claims = conn.channel()
    for name in catalog:
        try:
            claims.queue_declare(f"{exchange}.claim.{name}", exclusive=True)
            counts["claims squatted (unsealed names)"] += 1
        except pika.exceptions.ChannelClosed:
            claims = conn.channel()
    leaked = []
    for queue in cfg["leaked_claims"]:
        c = conn.channel()
        try:
            c.queue_declare(queue, exclusive=True)
            counts["leaked sealed claims squatted"] += 1
            leaked.append(c)
        except pika.exceptions.ChannelClosed:
            counts["leaked sealed claims already held"] += 1
    mine = set()

    def props(kind, corr, reply_to=None, headers=None):
        return pika.BasicProperties(content_type="application/json", type=kind, correlation_id=corr,
                                    reply_to=reply_to, headers=headers, expiration="2000")

    # Sealed queries heard in an earlier run: stale now (sealed > 30 s ago).
    old = []
    if os.path.exists(cfg["heard_file"]):
        with open(cfg["heard_file"]) as f:
            old = json.load(f)
    now_ms = int(time.time() * 1000)
    for q in old[-20:]:
        if now_ms - q["headers"].get("x-iiw-peer-time", now_ms) > 31_000:
            mine.add(q["corr"])
            ch.basic_publish(exchange, q["key"], q["body"].encode(),
                             props("query", q["corr"], q["reply_to"], q["headers"]))
            counts["stale queries replayed"] += 1
    # Unsigned queries of its own, for names it can compute.
    for name in rng.sample(sorted(catalog), min(10, len(catalog))):
        corr = f"impostor-{rng.randbytes(8).hex()}"
        mine.add(corr)
        body = json.dumps({"name": name, "host": "impostor", "process": "p"}).encode()
        ch.basic_publish(exchange, f"query.{name}", body, props("query", corr, inbox))
        counts["unsigned queries"] += 1

    def offers(name, corr, query_headers):
        """The forged offers for one query: (body, headers, counter)."""
        facts = catalog.get(name) or {"href": "", "sha256": rng.randbytes(32).hex(), "fmt": "qcow2"}
        url = cfg["evil_url"]
        converted = facts["fmt"] == "qcow2"
        master = {"size": evil_facts["size"], "md5": evil_facts["md5"], "sha256": evil_facts["sha256"],
                  "sha512": None, "converted": converted, "disk_format": "raw",
                  "source_format": facts["fmt"], "source": facts["href"],
                  "fetched_at": int(time.time()) + 60, "source_last_modified": None,
                  "source_size": evil_facts["size"], "source_md5": None,
                  "source_sha256": facts["sha256"], "source_sha512": None}
        verified = json.dumps({"name": name, "host": "impostor", "process": "p", "url": url,
                               "state": "verified", "master": master}).encode()
        downloading = json.dumps({"name": name, "host": "impostor", "process": "p", "url": url,
                                  "state": "downloading", "live_size": evil_facts["size"]}).encode()
        made_up = {"x-iiw-peer-time": int(time.time() * 1000), "x-iiw-peer-mac": "ab" * 32}
        return [(verified, None, "offers unsigned"),
                (verified, made_up, "offers made-up seal"),
                (verified, sealed_headers(wrong_key, "offer", corr, "", verified),
                 "offers sealed with another key"),
                (downloading, sealed_headers(wrong_key, "offer", corr, "", downloading),
                 "downloading offers sealed with another key"),
                (verified, dict(query_headers), "offers with the query's seal copied")]

    heard = []

    def on_query(channel, method, p, body):
        corr, reply_to = p.correlation_id, p.reply_to
        if p.type != "query" or not corr or not reply_to or corr in mine:
            return
        mine.add(corr)
        try:
            name = json.loads(body)["name"]
        except (ValueError, KeyError, TypeError):
            return
        counts["queries heard"] += 1
        headers = dict(p.headers or {})
        headers = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in headers.items()}
        for data, hdrs, counter in offers(name, corr, headers):
            channel.basic_publish("", reply_to, data, props("offer", corr, headers=hdrs))
            counts[counter] += 1
        # The query again as it was heard (a replay), and redirected to the inbox.
        channel.basic_publish(exchange, method.routing_key, body, props("query", corr, reply_to, headers))
        counts["queries replayed as heard"] += 1
        channel.basic_publish(exchange, method.routing_key, body, props("query", corr, inbox, headers))
        counts["queries replayed to its own inbox"] += 1
        heard.append({"key": method.routing_key, "body": body.decode(), "corr": corr,
                      "reply_to": reply_to, "headers": headers})

    def on_answer(_channel, _method, _p, _body):
        counts["answers to the impostor"] += 1

    ch.basic_consume(heard_q, on_query, auto_ack=True)
    ch.basic_consume(inbox, on_answer, auto_ack=True)
    end = time.monotonic() + cfg["seconds"]
    while time.monotonic() < end:
        conn.process_data_events(time_limit=0.1)
    # Late answers to its queries (none must come).
    conn.process_data_events(time_limit=1)
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - the counts matter, not a clean close
        pass
    with open(cfg["heard_file"], "w") as f:
        json.dump((old + heard)[-200:], f)
    print(json.dumps(counts))


if __name__ == "__main__":
    if sys.argv[1] == "source":
        source(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "flood":
        flood(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1] == "evil":
        evil(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "impostor":
        impostor(sys.argv[2])
    else:
        sys.exit(f"unknown helper {sys.argv[1]}")
