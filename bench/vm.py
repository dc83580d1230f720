"""What a user gains from ``direct-worker``, on real machines: N QEMU VMs
booted from the real ironic-python-agent ramdisk, deployed at once by one
real Ironic 39 with one image, through stock ``direct``, through
``direct-worker`` and through ``direct-worker`` with ``[http] gzip =
"static"``, alternated run by run. The tests (tests/vm/deploy.py, whose
harness this reuses) prove that such deploys work; this measures what they
cost: the time from the deploy request to the last node ``active``, the CPU
of Ironic's process (API and conductor, with its children: it runs
``qemu-img``) and of the worker, the bytes the image server sent, and where
the time went. In each round it also has Ironic's own code do on its own
what stock ``direct`` does to the image (bench/vm_image_work.py: download,
sha256, inspection, ``qemu-img convert -O raw``, one sha256 of the raw image
per node), so that the targets are checked against figures of the same
machine at the same time:

* Ironic's CPU for a ``direct-worker`` deploy is stock's less that image
  work, within 10% of the image work;
* the time to all ``active`` is no longer than stock's;
* with gzip, the bytes sent per node are at most 1/4 of the image.

Bytes are counted by an iptables rule without a target (it only counts) on
the image server's port on the loopback, the same way for Ironic's own HTTP
server and the worker's: TCP/IP headers included, the conductor's HEAD
requests too. Each VM is powered on when Ironic powers its node on (the node
reaches ``wait call-back``), as a BMC would. The VMs stand for machines with
CPUs of their own: under TCG each would take a core of the conductor host's,
so they run niced (``--vm-nice``, 10 by default: the priority of the
worker's compressor) and the host's own processes (Ironic, the worker) come
first.

Run by bench/vm, which builds the worker, the ramdisk and the plug-in.
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'tests', 'vm'))
import deploy  # noqa: E402 (the VM harness)
from deploy import GiB, log  # noqa: E402

# Mode: (the harness's scenario, more options of the worker's [http]).
MODES = {
    'direct': ('direct', ''),
    'worker': ('amqp', ''),
    'worker+gzip': ('amqp', 'gzip = "static"'),
}
# Seconds between two looks at the nodes' states.
POLL = 0.5
# The plug-in's default look at a prepare under way (the tests' harness looks
# every 0.5 s to be quick); what a user's deploy does.
IRONIC_OPTIONS = {'image_worker': {'poll_interval': '2.0'}}
# Ironic's line for a heartbeat it drops (the node locked): the agent's next
# one comes a heartbeat interval later.
DROPPED = 'skipping heartbeat processing'


def loadavg():
    with open('/proc/loadavg') as f:
        return ' '.join(f.read().split()[:3])


def tree_cpu(pid):
    """CPU seconds (user + system) of a process and its descendants, the
    live ones and those reaped."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root] + root.children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class Wire(object):
    """Bytes sent from 127.0.0.1:``port`` on the loopback, counted by an
    iptables rule without a target."""

    def __init__(self, port):
        self.port = port
        self.rule = ['OUTPUT', '-o', 'lo', '-p', 'tcp', '--sport', str(port),
                     '-m', 'comment', '--comment', 'bench-vm']
        subprocess.run(['iptables', '-A'] + self.rule, check=True)

    def bytes(self):
        out = subprocess.run(['iptables', '-L', 'OUTPUT', '-n', '-v', '-x'],
                             check=True, capture_output=True,
                             text=True).stdout
        for line in out.splitlines():
            if 'spt:%d ' % self.port in line and 'bench-vm' in line:
                return int(line.split()[1])
        raise AssertionError('the counting rule of port %d is gone'
                             % self.port)

    def stop(self):
        subprocess.run(['iptables', '-D'] + self.rule, check=True)


def image_work(url, checksum, workdir, nodes):
    """Stock ``direct``'s work on the image for ``nodes`` nodes, done on its
    own by Ironic's own code (bench/vm_image_work.py): its wall and CPU
    seconds."""
    into = tempfile.mkdtemp(prefix='image-work-', dir=workdir)
    try:
        out = subprocess.run(
            [sys.executable, os.path.join(os.path.dirname(
                os.path.abspath(__file__)), 'vm_image_work.py'),
             url, checksum, into, str(nodes)],
            check=True, capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(into, ignore_errors=True)
    return json.loads(out.splitlines()[-1])


class Trial(object):
    """One deploy of ``opts.nodes`` VMs in one mode, measured."""

    def __init__(self, mode, opts, workdir, source, image, checksum):
        """``image``: the qcow2 and its conversion by qemu-img;
        ``checksum``: the qcow2's sha256."""
        self.mode = mode
        self.kind, self.http = MODES[mode]
        self.opts = opts
        self.dir = tempfile.mkdtemp(prefix='%s-' % mode, dir=workdir)
        self.source = source
        self.img, self.ref = image
        self.checksum = checksum
        self.cleanups = []

    def run(self, logs):
        """The figures; the logs of Ironic, the worker and the VMs' consoles
        copied under ``logs`` (when given) once done."""
        try:
            return self._run()
        finally:
            if logs:
                self._keep_logs(logs)
            for stop in reversed(self.cleanups):
                try:
                    stop()
                except Exception as e:  # noqa: the first failure is shown
                    log('%s: cleanup: %r' % (self.mode, e))
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self):
        worker, own_root, ironic, _ = deploy.services(
            self.kind, self.dir, self.opts.worker, self.cleanups, self.http,
            IRONIC_OPTIONS)
        served = worker.http_port if worker else own_root.port
        wire = Wire(served)
        self.cleanups.append(wire.stop)
        nodes = self._nodes(ironic)
        processes = [ironic.proc.pid] + ([worker.proc.pid] if worker else [])
        idle = idle_rate(ironic.proc.pid)
        load = [loadavg()]
        before = [tree_cpu(p) for p in processes] + [wire.bytes()]
        started = time.monotonic()
        for node in nodes:
            ironic.provision(node['uuid'], 'active')
        stages, vms = self._follow(ironic, nodes, served, started)
        after = [tree_cpu(p) for p in processes] + [wire.bytes()]
        load.append(loadavg())
        for vm in vms:
            vm.wait_off(180)
            deploy.check_disk(self.mode, vm.disk, self.ref)
        spent = [b - a for a, b in zip(before, after)]
        return {
            'mode': self.mode,
            'active': max(s['active'] for s in stages),
            'ironic_cpu': spent[0],
            'ironic_idle': idle,
            'worker_cpu': spent[1] if worker else None,
            'wire': spent[-1],
            'stages': stages,
            'prepare': worker_prepares(worker) if worker else None,
            'dropped': dropped_heartbeats(ironic),
            'load': load,
        }

    def _keep_logs(self, logs):
        into = os.path.join(logs, os.path.basename(self.dir))
        os.makedirs(into)
        for path in glob.glob(os.path.join(self.dir, '*', '*.log')):
            shutil.copy(path, os.path.join(into, '%s-%s' % tuple(
                path.split(os.sep)[-2:])))

    def _nodes(self, ironic):
        url = self.source.url(os.path.basename(self.img))
        nodes = [ironic.node() for _ in range(self.opts.nodes)]
        for node in nodes:
            ironic.call('PATCH', '/v1/nodes/%s' % node['uuid'],
                        deploy.deploy_patch(self.kind, url, self.checksum))
        return nodes

    def _follow(self, ironic, nodes, served, started):
        """Follows the nodes until all are ``active``, powering each VM on
        when Ironic powers its node on; returns per node the seconds from
        the request to its power-on, to its agent's first heartbeat and to
        ``active``, and the VMs. Reads Ironic's database rather than its
        API, whose CPU is measured."""
        stages = {n['uuid']: {} for n in nodes}
        macs = {n['uuid']: n['mac'] for n in nodes}
        vms = []
        deadline = started + self.opts.timeout
        db = sqlite3.connect('file:%s?mode=ro' % os.path.join(
            ironic.dir, 'ironic.sqlite'), uri=True, timeout=30)
        while not all('active' in s for s in stages.values()):
            if time.monotonic() > deadline:
                raise AssertionError('%s: not all active within %ss: %r\n%s'
                                     % (self.mode, self.opts.timeout, stages,
                                        ironic.tail(30)))
            rows = db.execute('SELECT uuid, provision_state, last_error, '
                              'driver_internal_info FROM nodes').fetchall()
            now = time.monotonic() - started
            for uuid_, state, error, internal in rows:
                seen = stages[uuid_]
                if state == 'deploy failed':
                    raise AssertionError('%s: deploy failed: %s\n%s' % (
                        self.mode, error,
                        '\n'.join(vm.tail() for vm in vms)))
                if state == 'wait call-back' and 'power on' not in seen:
                    seen['power on'] = now
                    vm = deploy.Vm(self.dir, self.opts.ramdisk, macs[uuid_],
                                   ironic.port, [served],
                                   nice=self.opts.vm_nice)
                    self.cleanups.append(vm.stop)
                    vms.append(vm)
                if json.loads(internal or '{}').get('agent_url'):
                    seen.setdefault('heartbeat', now)
                if state == 'active':
                    seen.setdefault('active', now)
            time.sleep(POLL)
        db.close()
        return list(stages.values()), vms


def idle_rate(pid, seconds=10):
    """CPU seconds per second of a process tree with nothing to do."""
    before = tree_cpu(pid)
    time.sleep(seconds)
    return (tree_cpu(pid) - before) / seconds


def worker_prepares(worker):
    """The seconds each ``prepare`` took the worker, from its log."""
    with open(worker.log_path, errors='replace') as f:
        return [int(m.group(1)) / 1000 for m in (
            re.search(r'duration_ms=(\d+)', line) for line in f
            if 'request done' in line and 'action="prepare"' in line) if m]


def dropped_heartbeats(ironic):
    """How many heartbeats Ironic dropped because the node was locked."""
    with open(os.path.join(ironic.dir, 'ironic.log'), errors='replace') as f:
        return sum(DROPPED in line for line in f)


def mean(values):
    return sum(values) / len(values)


def print_round(n, result):
    s = result['stages']
    phases = 'power-on %.1f s, to the first heartbeat taken %.1f s, to ' \
        'active %.1f s' % (mean([x['power on'] for x in s]),
                    mean([x['heartbeat'] - x['power on'] for x in s]),
                    mean([x['active'] - x['heartbeat'] for x in s]))
    worker = ''
    if result['worker_cpu'] is not None:
        worker = ', worker CPU %.1f s, prepare %s s' % (
            result['worker_cpu'],
            '/'.join('%.1f' % p for p in result['prepare']))
    log('run %d %s: all active after %.1f s; Ironic CPU %.1f s (idle: %.3f '
        's/s)%s; %d bytes sent; per node (mean) %s; heartbeats dropped (node '
        'locked) %d; load %s -> %s' % (
            n, result['mode'], result['active'], result['ironic_cpu'],
            result['ironic_idle'], worker, result['wire'], phases,
            result['dropped'], *result['load']))


def summary(results, works, opts, image_size):
    """The medians per mode and a PASS or FAIL per target."""
    by = {m: [r for r in results if r['mode'] == m] for m in MODES}

    def med(mode, key):
        return statistics.median(r[key] for r in by[mode])

    work_cpu = statistics.median(w['cpu'] for w in works)
    work_wall = statistics.median(w['wall'] for w in works)
    print('\n| mode | all active (s) | Ironic CPU (s) | worker CPU (s) | '
          'bytes sent per node |\n|---|---|---|---|---|')
    for mode in MODES:
        worker = ('%.1f' % med(mode, 'worker_cpu')
                  if by[mode][0]['worker_cpu'] is not None else '-')
        print('| %s | %.1f | %.1f | %s | %s |' % (
            mode, med(mode, 'active'), med(mode, 'ironic_cpu'), worker,
            format(int(med(mode, 'wire') / opts.nodes), ',')))
    print('| image work on its own | %.1f | %.1f | | |' % (work_wall,
                                                           work_cpu))
    print('(medians of %d runs, %d nodes each)\n' % (len(works),
                                                     opts.nodes))
    stock = med('direct', 'ironic_cpu')
    verdicts = []
    for mode in ('worker', 'worker+gzip'):
        left = med(mode, 'ironic_cpu') - (stock - work_cpu)
        verdicts.append(('%s: Ironic CPU - (stock - image work) = %.1f - '
                         '(%.1f - %.1f) = %+.1f s (|.| <= 10%% of %.1f s)' % (
                             mode, med(mode, 'ironic_cpu'), stock, work_cpu,
                             left, work_cpu), abs(left) <= 0.1 * work_cpu))
        verdicts.append(('%s: all active %.1f s / stock %.1f s (<= 1)' % (
            mode, med(mode, 'active'), med('direct', 'active')),
            med(mode, 'active') <= med('direct', 'active')))
    per_node = med('worker+gzip', 'wire') / opts.nodes
    verdicts.append(('worker+gzip: bytes sent per node / image = %s / %s = '
                     '%.3f (<= 1/4)' % (format(int(per_node), ','),
                                        format(image_size, ','),
                                        per_node / image_size),
                     per_node <= image_size / 4))
    for text, ok in verdicts:
        print('%s %s' % (text, 'PASS' if ok else 'FAIL'))
    return all(ok for _, ok in verdicts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--worker', required=True,
                        help='the ironic-image-worker binary')
    parser.add_argument('--ramdisk', required=True,
                        help='directory with vmlinuz and initramfs')
    parser.add_argument('--workdir', default='/var/tmp')
    parser.add_argument('--nodes', type=int, default=3,
                        help='VMs deployed at once')
    parser.add_argument('--runs', type=int, default=3,
                        help='runs of each mode, alternated')
    parser.add_argument('--timeout', type=int, default=1500,
                        help='seconds a deploy of the nodes may take')
    parser.add_argument('--budget', type=float, default=float('inf'),
                        help='minutes: no run is started that would end '
                        'after them at the pace of the longest run so far')
    parser.add_argument('--logs',
                        help="keep Ironic's, the worker's and the VMs' logs "
                        'under this directory')
    parser.add_argument('--vm-nice', type=int, default=10,
                        help="the VMs' niceness: they stand for machines "
                        "with CPUs of their own, so the conductor host's "
                        'processes (Ironic, the worker) come first on the '
                        'shared cores')
    parser.add_argument('--virtual-gib', type=int, default=2)
    parser.add_argument('--data-gib', type=float, default=1)
    parser.add_argument('--density', type=float, default=1 / 3,
                        help='share of each 4 KiB block of the data that '
                        'is random (the rest zeros); 1: all random')
    opts = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix='iiw-bench-vm-', dir=opts.workdir)
    os.makedirs(os.path.join(workdir, 'src'))
    source = deploy.Source(os.path.join(workdir, 'src'))
    try:
        virtual = opts.virtual_gib * GiB
        image = deploy.make_image(workdir, 'image', virtual,
                                  int(opts.data_gib * GiB), 1, opts.density)
        log('image: %d bytes of qcow2, %d virtual; %d nodes, %d runs each'
            % (os.path.getsize(image[0]), virtual, opts.nodes, opts.runs))
        checksum = deploy.file_hash(image[0])
        results, works = [], []
        deadline = time.monotonic() + opts.budget * 60
        longest = 0
        for n in range(1, opts.runs + 1):
            if time.monotonic() + longest > deadline:
                log('run %d would end after --budget: not started' % n)
                break
            started = time.monotonic()
            works.append(image_work(source.url('image.qcow2'), checksum,
                                    workdir, opts.nodes))
            log('run %d image work on its own: %.1f s, CPU %.1f s' % (
                n, works[-1]['wall'], works[-1]['cpu']))
            for mode in MODES:
                results.append(Trial(mode, opts, workdir, source, image,
                                     checksum).run(opts.logs))
                print_round(n, results[-1])
            longest = max(longest, time.monotonic() - started)
        ok = summary(results, works, opts, virtual)
    finally:
        source.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
