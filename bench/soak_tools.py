#!/usr/bin/env python3
"""Helper processes of bench/soak, each run as a process of its own so that
the driver's threads do not share its interpreter:

    soak_tools.py source DIR PORT SLOW_RATE   the image source: /fast/NAME at
        full speed, /slow/NAME throttled to SLOW_RATE bytes/s per
        connection (query strings ignored, so ?v=N names another master)
    soak_tools.py flood PORT COUNT SECONDS    COUNT slow clients against an
        image server: half request headers, and requests never read
"""

import http.server
import os
import resource
import socket
import sys
import time


class Source(http.server.BaseHTTPRequestHandler):
    """GET/HEAD of a file under the served directory, maybe throttled."""

    protocol_version = "HTTP/1.1"
    root = "."
    slow_rate = 1 << 20

    def log_message(self, fmt, *args):
        pass

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
        self._answer(body=True)

    def _answer(self, body):
        full, slow = self._file()
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
                if slow:
                    ahead = sent / self.slow_rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)


def source(root, port, slow_rate):
    Source.root = root
    Source.slow_rate = slow_rate
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Source)
    server.daemon_threads = True
    server.serve_forever()


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


if __name__ == "__main__":
    if sys.argv[1] == "source":
        source(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "flood":
        flood(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit(f"unknown helper {sys.argv[1]}")
