#!/usr/bin/env python3
"""Where the cores go while one command runs: its threads' states sampled.

    bench/threads.py CMD ARGS...

Runs CMD (stdout discarded) and reads /proc/PID/task/*/stat every 20 ms:
prints, per thread name, the share of samples it was running (R), waiting
for the disk (D) or sleeping (S); its CPU time (user + system, as of the
last sample: a thread that ended earlier counts up to then); and for each
count N the share of samples with N threads running. On a 2-core machine
the samples with one thread running are the time a core had nothing to
do, whatever the CPU total says. Not a timing: run it beside `bench/run`.
"""
import collections
import os
import subprocess
import sys
import time

proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
states = collections.defaultdict(collections.Counter)
cpu = {}
running = collections.Counter()
tick = os.sysconf("SC_CLK_TCK")
samples = 0
start = time.time()
while proc.poll() is None:
    busy = 0
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        break
    for tid in tids:
        try:
            stat = open(f"/proc/{proc.pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        states[name][fields[0]] += 1
        cpu[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
        busy += fields[0] == "R"
    running[busy] += 1
    samples += 1
    time.sleep(0.02)
print(f"wall {time.time() - start:.2f} s, {samples} samples, exit {proc.wait()}")
for name, counts in sorted(states.items()):
    total = sum(counts.values())
    shares = " ".join(f"{s}:{100 * n / total:4.0f}%" for s, n in sorted(counts.items()))
    print(f"  {name:16s} {shares}")
per_name = collections.defaultdict(float)
for name, seconds in cpu.values():
    per_name[name] += seconds
print("  CPU per thread name: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(per_name.items())))
print("  samples with N threads running: "
      + ", ".join(f"{n}: {100 * c / max(samples, 1):.0f}%" for n, c in sorted(running.items())))
