#!/usr/bin/env python3
"""HEAD and GET-header latency of an image URL, idle and while a command runs.

Ironic 39 HEADs image URLs with ``webserver_verify_timeout = 5`` and the
agent's GET must see its headers promptly: the image server has to answer
while the same worker converts at full speed. This probes URL every
``--every`` ms (alternating a HEAD and a GET whose body is not read), first
for ``--idle`` seconds with nothing else running (the reference), then for as
long as COMMAND runs (e.g. ``ironic-image-worker send prepare ... --wait`` of
a large qcow2 to the same worker). Each probe is a new connection, as
Ironic's ``requests.head`` makes one. Prints the median, p99 and maximum of
each phase and ``RESULT p99_ms=<busy p99> idle_p99_ms=<idle p99>
max_ms=<busy max> probes=<n> over_5s=<n>``.

Usage: head_latency.py URL [--every MS] [--idle S] -- COMMAND...
"""

import argparse
import http.client
import statistics
import subprocess
import sys
import time
import urllib.parse


def probe(url, method):
    """Seconds until the status line and headers of one request arrived
    (a new connection each time); None when it failed or took over 5 s."""
    u = urllib.parse.urlsplit(url)
    started = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
        conn.request(method, u.path)
        resp = conn.getresponse()
        took = time.perf_counter() - started
        if resp.status != 200:
            print(f"{method} answered {resp.status}", file=sys.stderr)
        conn.close()
        return took
    except OSError as e:
        print(f"{method} failed: {e}", file=sys.stderr)
        return None


def phase(url, every, until):
    """Probes until ``until()`` is true; the latencies (ms) and failures."""
    lat, failed, n = [], 0, 0
    while not until():
        method = "HEAD" if n % 2 == 0 else "GET"
        n += 1
        took = probe(url, method)
        if took is None:
            failed += 1
        else:
            lat.append(took * 1000)
        time.sleep(every / 1000)
    return lat, failed


def summary(name, lat, failed):
    lat = sorted(lat)
    if not lat:
        print(f"{name}: no answer at all ({failed} failed)")
        return 0.0, 0.0
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    print(f"{name}: {len(lat)} probes, median {statistics.median(lat):.1f} ms, "
          f"p99 {p99:.1f} ms, max {lat[-1]:.1f} ms, {failed} failed or over 5 s")
    return p99, lat[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--every", type=float, default=20)
    ap.add_argument("--idle", type=float, default=3)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    end = time.monotonic() + a.idle
    idle, idle_failed = phase(a.url, a.every, lambda: time.monotonic() >= end)
    started = time.monotonic()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    busy, failed = phase(a.url, a.every, lambda: child.poll() is not None)
    took = time.monotonic() - started
    if child.returncode != 0:
        print(f"the command failed ({child.returncode})", file=sys.stderr)
        sys.exit(1)
    idle_p99, _ = summary("idle", idle, idle_failed)
    p99, worst = summary(f"during the command ({took:.1f} s)", busy, failed)
    print(f"RESULT p99_ms={p99:.1f} idle_p99_ms={idle_p99:.1f} max_ms={worst:.1f} "
          f"probes={len(busy)} over_5s={failed}")


if __name__ == "__main__":
    main()
