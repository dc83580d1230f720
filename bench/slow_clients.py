#!/usr/bin/env python3
"""Slow clients against the image server: holds N connections that sent half
a request header, then times a normal image GET, /readyz and a prepare over
the broker, and reports how many connections the server keeps.

    python3 bench/slow_clients.py BINARY [N] [--set http.max_connections=500 ...]

Needs RabbitMQ on 127.0.0.1:5672 (guest/guest). Prints figures, asserts
nothing about timings.
"""

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def timed(fn):
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def main():
    binary = os.path.abspath(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    extra = sys.argv[3:]
    tmp = tempfile.mkdtemp(prefix="slow-clients-")
    http_port, metrics_port = free_port(), free_port()
    host = f"bench-{uuid.uuid4().hex}"
    os.makedirs(f"{tmp}/allowed")
    config = f"{tmp}/worker.toml"
    with open(config, "w") as f:
        f.write(f"""
[DEFAULT]
host = "{host}"
[deploy]
http_root = "{tmp}/httpboot"
http_url = "http://127.0.0.1:{http_port}"
[pxe]
instance_master_path = "{tmp}/master_images"
images_path = "{tmp}/images"
[conductor]
file_url_allowed_paths = "{tmp}/allowed"
[http]
listen = "127.0.0.1:{http_port}"
[metrics]
listen = "127.0.0.1:{metrics_port}"
""")
    for name in ("a.img", "b.img"):
        with open(f"{tmp}/allowed/{name}", "wb") as f:
            f.write(os.urandom(16 << 20))
    base = [binary, "--config", config] + extra
    worker = subprocess.Popen(base + ["serve"], stderr=subprocess.DEVNULL,
                              env=dict(os.environ, RUST_LOG="warn"))
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=1)
                break
            except Exception:
                time.sleep(0.05)

        def prepare(name):
            node = str(uuid.uuid4())
            out = subprocess.run(base + ["send", "prepare", "--node", node,
                                         "--image-source", f"file://{tmp}/allowed/{name}", "--wait"],
                                 capture_output=True, text=True, timeout=300)
            text = out.stdout.replace(" ", "")
            return '"status":"success"' in text, text[-400:] or out.stderr[-300:]

        ok, url_event = prepare("a.img")
        assert ok, url_event
        url = re.search(r'"image_url":"([^"]+)"', url_event).group(1)

        def get():
            try:
                return len(urllib.request.urlopen(url, timeout=120).read())
            except Exception as e:
                return repr(e)

        def readyz():
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=60).status
            except Exception as e:
                return repr(e)

        t_get0, _ = timed(get)
        print(f"baseline: GET 16 MiB {t_get0 * 1000:.0f} ms")
        held = []
        t_open, _ = timed(lambda: [held.append(half_header(http_port)) for _ in range(n)])
        print(f"opened {len(held)} half-header connections in {t_open:.1f} s")
        kept = metric(metrics_port, "ironic_image_worker_http_connections_open")
        t_get, size = timed(get)
        t_ready, status = timed(readyz)
        t_prep, (prep_ok, detail) = timed(lambda: prepare("b.img"))
        kept_after = metric(metrics_port, "ironic_image_worker_http_connections_open")
        evicted = metric(metrics_port,
                         'ironic_image_worker_http_connections_dropped_total{reason="evicted"}')
        print(f"server keeps {kept:.0f} of {n} (after the requests: {kept_after:.0f}; "
              f"evicted so far {evicted:.0f})")
        print(f"GET 16 MiB: {t_get * 1000:.0f} ms ({size} bytes)")
        print(f"/readyz: {t_ready * 1000:.0f} ms ({status})")
        print(f"prepare (16 MiB file:// miss) over the broker: {t_prep * 1000:.0f} ms "
              f"({'success' if prep_ok else detail})")
        t0 = time.monotonic()
        while metric(metrics_port, "ironic_image_worker_http_connections_open") > 0:
            if time.monotonic() - t0 > 300:
                break
            time.sleep(0.5)
        closed = sum(1 for s in held if is_closed(s))
        print(f"after {time.monotonic() - t0:.1f} s more: server has "
              f"{metric(metrics_port, 'ironic_image_worker_http_connections_open'):.0f} open; "
              f"{closed} of {n} closed by the server")
    finally:
        worker.terminate()
        worker.wait(timeout=60)


def half_header(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /agent_images/x HTTP/1.1\r\nHost: slow\r\n")
    return s


def is_closed(s):
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


if __name__ == "__main__":
    main()
