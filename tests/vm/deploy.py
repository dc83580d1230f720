"""Real machine deploys: Ironic 39 (``ironic``, API and conductor in one
process) deploys a QEMU VM booted from a real ironic-python-agent 13
ramdisk (tests/vm/build-ramdisk) onto its blank virtual disk, through
``direct-worker`` and a real ironic-image-worker, or through Ironic's stock
``direct`` (the harness's own control: when it fails too, the harness is
broken, not the worker).

Two ways to boot the machine (``--boot``): ``fake`` (the default), a
fake-hardware node (fake power and boot) and a VM the harness starts itself
with the ramdisk's kernel and initramfs as the deploy starts; ``redfish``,
the Metal3 way (tests/vm/redfish.py): a ``redfish`` node (redfish power and
management, ``redfish-virtual-media`` boot) behind sushy-tools and its
libvirt driver, whose libvirt domain Ironic powers on itself to boot the
ISO it builds from the ramdisk, and powers on again from its disk at the
deploy's end.

Run with the Python of the Ironic virtualenv that has the deploy interface
installed (tests/vm.rs does, as ``cargo test --test vm``):

    python tests/vm/deploy.py --worker BIN --ramdisk DIR SCENARIO...

Scenarios: ``amqp`` (the worker over RabbitMQ on 127.0.0.1:5672),
``json-rpc`` (the worker with ``[amqp]enabled = false``, no broker),
``direct`` (stock Ironic, which downloads and converts the image itself),
and over RabbitMQ: ``gzip-tls`` (the image port with TLS, HTTP Basic and
``[http] gzip = "static"``: the agent, given the CA by its own ``cafile``
option and the credentials by Ironic, streams the compressed image to disk
through its decoder; ``--boot fake`` only: its CA goes into the ramdisk the
harness boots), ``oci`` (the image in a local registry, laid out as
``oras`` pushes a disk image) and ``worker-killed`` (the worker killed with
SIGKILL while it downloads the source, then started again, as the VM
boots). ``--rebuild`` then rebuilds the node with another image (a second
boot), ``--undeploy`` undeploys it with cleaning (another boot).
Each checks that the node became ``active``, that the VM powered itself
off, that the first bytes of its disk equal ``qemu-img convert -O raw`` of
the source qcow2, and who fetched the source: with the worker, only the
worker (its User-Agent) and nothing in Ironic's master image cache; with
``direct``, Ironic. ``--break wrong-file`` overwrites the node's served
file (and its compressed form) once the worker has published it
(``--break rebuild-wrong-file``: the file of the rebuild), ``--break
checksum`` gives Ironic a wrong checksum: each must fail the scenario.

Networking: QEMU's user network with ``restrict=on`` (nothing leaves the
machine); the agent is reached through a ``hostfwd`` on 127.0.0.1, and the
guest reaches the host's ports only through ``guestfwd`` rules, one per
port, which the ramdisk makes the guest's own 127.0.0.1:PORT (NAT), so the
URLs Ironic and the worker hand out (all ``127.0.0.1:PORT``) work on both
sides. KVM is used where it is ordinary KVM; TCG otherwise (the PVM flavour
of /dev/kvm hangs Debian's kernel at boot).
"""

import argparse
import glob
import hashlib
import http.server
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

from ironic_image_worker_deploy.tests import parts
from ironic_image_worker_deploy.tests import real_ironic

import console
import redfish

MiB = 1 << 20
GiB = 1 << 30
WORKER_AGENT = 'ironic-image-worker/'
# IPA's smallest root device is 4 GiB.
DISK_SIZE = 5 * GiB


def log(msg):
    print('[%7.1fs] %s' % (time.monotonic() - START, msg), flush=True)


START = time.monotonic()


def accelerator():
    """``kvm`` where /dev/kvm is usable ordinary KVM, else ``tcg``."""
    if os.path.exists('/sys/module/kvm_pvm'):
        return 'tcg'
    if os.access('/dev/kvm', os.R_OK | os.W_OK):
        return 'kvm'
    return 'tcg'


def file_hash(path, limit=None):
    """sha256 of the first ``limit`` bytes of ``path`` (all by default)."""
    h = hashlib.sha256()
    left = limit if limit is not None else float('inf')
    with open(path, 'rb') as f:
        while left > 0:
            chunk = f.read(int(min(4 * MiB, left)))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def make_image(workdir, name, virtual, data, seed, density=1.0):
    """A qcow2 of ``virtual`` bytes: an MBR partition table (the agent
    refuses a whole-disk image without one) and ``data`` bytes of data in
    four places of its partition; and its reference: ``qemu-img convert -O
    raw``. The data is random, or with ``density`` < 1 that share of each
    4 KiB block random and the rest zeros (compressible as an operating
    system's files are, yet every cluster of the qcow2 allocated)."""
    raw = os.path.join(workdir, name + '.raw')
    rnd = random.Random(seed)
    with open(raw, 'wb') as f:
        f.truncate(virtual)
        piece = data // 4
        for at in (MiB, virtual // 3, virtual // 2 + 4096, virtual - piece):
            f.seek(at)
            f.write(fill(rnd, piece, density))
        # One Linux partition from sector 2048 to the end.
        entry = struct.pack('<B3sB3sII', 0, b'\xfe\xff\xff', 0x83,
                            b'\xfe\xff\xff', 2048, virtual // 512 - 2048)
        f.seek(446)
        f.write(entry + bytes(48) + b'\x55\xaa')
    img = os.path.join(workdir, 'src', name + '.qcow2')
    ref = os.path.join(workdir, name + '.ref')
    run('qemu-img', 'convert', '-f', 'raw', '-O', 'qcow2', raw, img)
    run('qemu-img', 'convert', '-f', 'qcow2', '-O', 'raw', img, ref)
    os.unlink(raw)
    return img, ref


def fill(rnd, size, density):
    """``size`` bytes: random, or ``density`` of each 4 KiB block random
    and the rest zeros."""
    if density >= 1:
        return rnd.randbytes(size)
    block = 4096
    dense = int(block * density)
    random_part = rnd.randbytes(size // block * dense)
    out = bytearray(size)
    for i in range(size // block):
        out[i * block:i * block + dense] = \
            random_part[i * dense:(i + 1) * dense]
    return out


def run(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


class Source(object):
    """The image source: serves a directory, logging each request's method,
    path, User-Agent and client; ``throttle`` (bytes a second, 0: none)
    slows its bodies down."""

    def __init__(self, directory):
        self.requests = []
        self.throttle = 0
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def __init__(self, *a, **kw):
                super().__init__(*a, directory=directory, **kw)

            def log_message(self, *args):
                pass

            def send_head(self):
                outer.requests.append((self.command, self.path,
                                       self.headers.get('User-Agent', '')))
                return super().send_head()

            def copyfile(self, source, out):
                rate = outer.throttle
                if not rate:
                    return super().copyfile(source, out)
                chunk = max(rate // 10, 4096)
                while True:
                    data = source.read(chunk)
                    if not data:
                        return
                    out.write(data)
                    time.sleep(0.1)

        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                                     Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever,
                         daemon=True).start()

    def url(self, name):
        return 'http://127.0.0.1:%d/%s' % (self.port, name)

    def gets(self, name):
        return [ua for (m, p, ua) in self.requests
                if m == 'GET' and p == '/' + name]

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class Worker(console.LoggedProcess):
    """A real ironic-image-worker (``serve``) with its own directories;
    ``http``: more options of its ``[http]`` section, ``extra``: more
    sections."""

    def __init__(self, binary, workdir, extra='', http='', scheme='http'):
        self.binary = binary
        self.root = tempfile.mkdtemp(prefix='worker-', dir=workdir)
        self.host = 'vm-%s' % uuid.uuid4().hex[:12]
        self.http_port = real_ironic.free_port()
        self.metrics_port = real_ironic.free_port()
        self.http_root = os.path.join(self.root, 'httpboot')
        self.images_path = os.path.join(self.root, 'images')
        self.masters = os.path.join(self.root, 'master_images')
        self.http_url = '%s://127.0.0.1:%d' % (scheme, self.http_port)
        self.config = os.path.join(self.root, 'worker.toml')
        with open(self.config, 'w') as f:
            f.write('[DEFAULT]\nhost = "%s"\n'
                    '[deploy]\nhttp_root = "%s"\n'
                    'http_url = "%s"\n'
                    '[pxe]\ninstance_master_path = "%s"\n'
                    'images_path = "%s"\n'
                    '[http]\nlisten = "127.0.0.1:%d"\n%s\n'
                    '[metrics]\nlisten = "127.0.0.1:%d"\n%s\n'
                    % (self.host, self.http_root, self.http_url,
                       self.masters, self.images_path, self.http_port, http,
                       self.metrics_port, extra))
        self.proc = None
        self.log_path = os.path.join(self.root, 'worker.log')

    def start(self):
        environ = dict(os.environ, RUST_LOG='info,lapin=warn')
        environ.pop('IRONIC_IMAGE_WORKER_CONFIG', None)
        self.log = open(self.log_path, 'ab')
        self.proc = subprocess.Popen(
            [self.binary, '--config', self.config, 'serve'],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            env=environ)
        url = 'http://127.0.0.1:%d/readyz' % self.metrics_port
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError('the worker exited with %s:\n%s'
                                     % (self.proc.returncode, self.tail()))
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError('the worker did not become ready:\n%s'
                             % self.tail())

    def kill(self):
        """SIGKILL, as a crash or the OOM killer would end it."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def metric(self, name, labels=''):
        """The value of ``ironic_image_worker_<name>{<labels>}`` (0 when
        absent)."""
        url = 'http://127.0.0.1:%d/metrics' % self.metrics_port
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        want = 'ironic_image_worker_%s%s ' % (
            name, '{%s}' % labels if labels else '')
        for line in text.splitlines():
            if line.startswith(want):
                return float(line.split()[-1])
        return 0.0



def agent_params(api_port, agent_port, ports, verify_tls=False):
    """The kernel command line of the agent's ramdisk: the guest's console,
    where the agent finds Ironic and says it is (127.0.0.1:``agent_port``,
    the hostfwd), and the host's ``ports`` its ramdisk forwards;
    ``verify_tls``: the agent verifies certificates (with a CA of its own
    configuration)."""
    return ' '.join([
        'console=ttyS0', 'quiet', 'panic=-1', 'net.ifnames=0',
        # The TSC calibrates wrongly on a busy host under TCG; HPET
        # keeps the guest's clock (its TLS certificate's dates) right.
        'clocksource=hpet',
        'ipa-api-url=http://127.0.0.1:%d' % api_port,
        'ipa-advertise-host=127.0.0.1',
        'ipa-advertise-port=%d' % agent_port,
        'ipa-insecure=%d' % (not verify_tls), 'ipa-lookup-interval=2',
        'ipa-http-request-timeout=120',
        # A download that fails its checksum is tried again once, not
        # nine times (minutes each under emulation).
        'ipa-image-download-connection-retries=1',
        'iiw.forward=%s' % ','.join(str(p) for p in ports)])


class Vm(console.SerialConsole):
    """A QEMU machine booted from the agent's ramdisk with a blank disk;
    its agent reports to Ironic's API on 127.0.0.1 and reaches ``ports``
    of the host."""

    def __init__(self, workdir, ramdisk, mac, api_port, ports, memory=1536,
                 disk=None, files=None, nice=0):
        """``disk``: the disk of an earlier boot of the same machine;
        ``files``: {path: bytes} added to the ramdisk (an agent
        configuration file in /etc makes it verify TLS, which it otherwise
        does not: ``ipa-insecure``); ``nice``: QEMU's niceness."""
        self.dir = tempfile.mkdtemp(prefix='vm-', dir=workdir)
        self.disk = disk or os.path.join(self.dir, 'disk.raw')
        if disk is None:
            with open(self.disk, 'wb') as f:
                f.truncate(DISK_SIZE)
        self.console = os.path.join(self.dir, 'console.log')
        self.agent_port = real_ironic.free_port()
        ports = sorted(set([api_port] + list(ports)))
        netdev = ['user', 'id=n0', 'restrict=on',
                  'hostfwd=tcp:127.0.0.1:%d-:9999' % self.agent_port]
        netdev += ['guestfwd=tcp:10.0.2.100:%d-cmd:socat - TCP:127.0.0.1:%d'
                   % (p, p) for p in ports]
        append = agent_params(api_port, self.agent_port, ports,
                              verify_tls=bool(files))
        self.accel = accelerator()
        cmd = ['nice', '-n', str(nice),
               'qemu-system-x86_64', '-nodefaults', '-machine', 'pc',
               '-accel', self.accel,
               '-m', str(memory), '-smp', '1', '-no-reboot',
               '-display', 'none', '-monitor', 'none',
               '-serial', 'file:%s' % self.console,
               '-kernel', os.path.join(ramdisk, 'vmlinuz'),
               '-initrd', self._initrd(ramdisk, files or {}),
               '-append', append,
               '-drive', 'file=%s,format=raw,if=virtio,cache=unsafe'
               % self.disk,
               '-netdev', ','.join(netdev),
               '-device', 'virtio-net-pci,netdev=n0,mac=%s' % mac]
        self.qemu_log = open(os.path.join(self.dir, 'qemu.log'), 'wb')
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                     stdout=self.qemu_log,
                                     stderr=subprocess.STDOUT)

    def _initrd(self, ramdisk, files):
        """The ramdisk after an uncompressed cpio archive of ``files``
        (the kernel unpacks one after the other, as with early microcode)."""
        base = os.path.join(ramdisk, 'initramfs')
        if not files:
            return base
        tree = os.path.join(self.dir, 'extra')
        for path, data in files.items():
            target = os.path.join(tree, path.lstrip('/'))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, 'wb') as f:
                f.write(data)
        names = subprocess.run(['find', '.'], cwd=tree, check=True,
                               capture_output=True).stdout
        archive = subprocess.run(['cpio', '--create', '--format=newc',
                                  '--quiet'], cwd=tree, input=names,
                                 check=True, capture_output=True).stdout
        initrd = os.path.join(self.dir, 'initramfs')
        with open(initrd, 'wb') as out, open(base, 'rb') as f:
            out.write(archive)
            shutil.copyfileobj(f, out)
        return initrd

    def wait_off(self, within):
        """Waits for the guest to power itself off (QEMU exits)."""
        try:
            self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError('the VM did not power off within %ss:\n%s'
                                 % (within, self.tail()))
        return time.monotonic() - self.started

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.qemu_log.close()


def ironic_sections(kind, worker, own_http_root, json_rpc_port):
    """ironic.conf of a scenario (on top of real_ironic's own)."""
    sections = {
        'DEFAULT': {'enabled_deploy_interfaces': 'direct-worker,direct,fake',
                    'debug': 'true'},
        # Automated cleaning (--undeploy) erases only the disk's metadata
        # (the whole disk would take the agent minutes under emulation).
        'deploy': {'default_boot_mode': 'bios',
                   'erase_devices_priority': '0',
                   'erase_devices_metadata_priority': '10'},
        # A guest under emulation on a busy host answers slowly: Ironic
        # retries its calls to the agent rather than failing the deploy.
        'agent': {'image_download_source': 'local',
                  'max_command_attempts': '10',
                  'command_wait_interval': '3',
                  'command_timeout': '120'},
        'pxe': {},
        'image_worker': {'prepare_timeout': '600', 'poll_interval': '0.5'},
    }
    if worker is None:
        sections['deploy'].update(
            http_url='http://127.0.0.1:%d' % own_http_root.port,
            http_root=own_http_root.directory)
        return sections
    sections['deploy'].update(http_url=worker.http_url,
                              http_root=worker.http_root)
    sections['pxe']['images_path'] = worker.images_path
    if kind == 'amqp':
        sections['DEFAULT'].update(
            host=worker.host,
            transport_url='rabbit://guest:guest@127.0.0.1:5672/')
        sections['image_worker']['transport'] = 'amqp'
    else:
        sections['image_worker']['transport'] = 'json-rpc'
        sections['image_worker_json_rpc'] = {
            'host_ip': '127.0.0.1', 'port': str(json_rpc_port),
            'auth_strategy': 'noauth', 'use_ssl': 'false'}
    return sections


class HttpRoot(object):
    """Ironic's own HTTP server (stock ``direct`` serves its converted
    images from ``[deploy]http_root``)."""

    def __init__(self, workdir):
        self.directory = tempfile.mkdtemp(prefix='httproot-', dir=workdir)
        self.server = Source(self.directory)
        self.port = self.server.port

    def stop(self):
        self.server.stop()


def services(kind, workdir, binary, cleanups, worker_http='',
             ironic_options=None, worker_extra='', scheme='http'):
    """The worker (or Ironic's own HTTP root) of a ``kind`` of deploy
    (``amqp``, ``json-rpc`` or ``direct``) and Ironic, each stop appended
    to ``cleanups``; ``worker_http``: more options of the worker's
    ``[http]``, ``worker_extra``: more of its sections, ``scheme``: of its
    image URLs, ``ironic_options``: of Ironic's sections. Returns them and
    Ironic's master image directory."""
    worker = own_root = None
    rpc_port = real_ironic.free_port()
    if kind == 'direct':
        own_root = HttpRoot(workdir)
        cleanups.append(own_root.stop)
    else:
        extra = worker_extra
        if kind == 'json-rpc':
            extra += ('[amqp]\nenabled = false\n[json_rpc]\n'
                      'listen = "127.0.0.1:%d"\nauth_strategy = "noauth"\n'
                      % rpc_port)
        worker = Worker(binary, workdir, extra, worker_http, scheme)
        cleanups.append(worker.stop)
        worker.start()
    sections = ironic_sections(kind, worker, own_root, rpc_port)
    master = os.path.join(workdir, 'ironic-master')
    sections['pxe']['instance_master_path'] = master
    sections['pxe'].setdefault('images_path',
                               os.path.join(workdir, 'ironic-images'))
    for name, options in (ironic_options or {}).items():
        sections.setdefault(name, {}).update(options)
    ironic = real_ironic.Ironic(workdir, sections)
    cleanups.append(ironic.stop)
    return worker, own_root, ironic, master


def deploy_patch(kind, url, checksum):
    """The node PATCH of a deploy of the qcow2 at ``url``; ``checksum``:
    its sha256 (None for an OCI image, whose digest is its checksum)."""
    info = {'image_source': url, 'image_disk_format': 'qcow2',
            'image_download_source': 'local'}
    if checksum is not None:
        info.update(image_os_hash_algo='sha256',
                    image_os_hash_value=checksum)
    patch = [{'op': 'add', 'path': '/instance_info', 'value': info}]
    if kind == 'direct':
        patch.append({'op': 'replace', 'path': '/deploy_interface',
                      'value': 'direct'})
    return patch


def check_disk(kind, disk, ref):
    """Fails unless the first bytes of ``disk`` equal ``ref``."""
    size = os.path.getsize(ref)
    got, want = file_hash(disk, size), file_hash(ref)
    if got != want:
        raise AssertionError(
            "%s: the VM's disk (first %d bytes, sha256 %s) is not qemu-img"
            "'s conversion of the source (%s)" % (kind, size, got, want))
    log("%s: the VM's disk equals qemu-img convert -O raw (%d bytes)"
        % (kind, size))


# The transport of each scenario's worker (``direct``: no worker).
TRANSPORT = {'amqp': 'amqp', 'json-rpc': 'json-rpc', 'direct': 'direct',
             'gzip-tls': 'amqp', 'oci': 'amqp', 'worker-killed': 'amqp'}
# The user the agent is handed for the image port (``gzip-tls``).
AGENT_USER = 'agent'
# The agent's configuration file: IPA reads /etc/<its program>.conf.
AGENT_CONF = '/etc/ironic-python-agent.conf'
AGENT_CA = '/etc/iiw-ca.pem'


class Images(object):
    """The run's source images (served by ``source``), each made on first
    use: ``get(name, seed, density)`` returns its qcow2 and reference."""

    def __init__(self, workdir, opts):
        self.workdir = workdir
        self.opts = opts
        self.made = {}

    def get(self, name, seed, density=1.0):
        if name not in self.made:
            self.made[name] = make_image(
                self.workdir, name, self.opts.virtual_mib * MiB,
                self.opts.image_mib * MiB, seed, density)
        return self.made[name]


def make_tls(directory):
    """A CA and a certificate of 127.0.0.1 it signed; returns the paths of
    the CA's certificate, the server's certificate and its key."""
    ca_key, ca = (os.path.join(directory, n) for n in ('ca.key', 'ca.pem'))
    key, csr, cert, ext = (os.path.join(directory, n) for n in (
        'tls.key', 'tls.csr', 'tls.pem', 'tls.ext'))
    ec = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes']
    run('openssl', 'req', '-x509', *ec, '-keyout', ca_key, '-out', ca,
        '-days', '2', '-subj', '/CN=iiw vm test CA')
    run('openssl', 'req', '-new', *ec, '-keyout', key, '-out', csr,
        '-subj', '/CN=127.0.0.1')
    with open(ext, 'w') as f:
        f.write('subjectAltName=IP:127.0.0.1\n')
    run('openssl', 'x509', '-req', '-in', csr, '-CA', ca, '-CAkey', ca_key,
        '-CAcreateserial', '-days', '2', '-extfile', ext, '-out', cert)
    return ca, cert, key


class Scenario(object):
    """One deploy of one VM, checked end to end."""

    def __init__(self, kind, opts, workdir, source, images):
        self.kind = kind
        self.transport = TRANSPORT[kind]
        self.opts = opts
        self.dir = tempfile.mkdtemp(prefix='%s-' % kind, dir=workdir)
        self.source = source
        self.images = images
        if kind == 'gzip-tls':
            # Compressible as an operating system's files are: gzip pays.
            self.img, self.ref = images.get('sparse', 57, density=0.25)
        else:
            self.img, self.ref = images.get('image', 56)
        self.name = os.path.basename(self.img)
        self.vm_files = None
        self.killed = None
        self.cleanups = []

    def run(self):
        try:
            return self._run()
        finally:
            for stop in reversed(self.cleanups):
                try:
                    stop()
                except Exception as e:  # noqa: the first failure is shown
                    log('%s: cleanup: %r' % (self.kind, e))

    def _services(self):
        """The worker (or Ironic's own HTTP root) and Ironic, set up as
        the scenario needs."""
        worker_http = worker_extra = ''
        ironic_options = {}
        scheme = 'http'
        if self.opts.boot == 'redfish':
            ironic_options = redfish.ironic_options(self.opts.ramdisk)
        if self.kind == 'gzip-tls':
            ca, cert, key = make_tls(self.dir)
            password = uuid.uuid4().hex
            worker_http = ('gzip = "static"\ntls_cert_file = "%s"\n'
                           'tls_key_file = "%s"\n'
                           'auth_strategy = "http_basic"\n'
                           'auth_user = "%s"\nauth_password = "%s"\n'
                           % (cert, key, AGENT_USER, password))
            scheme = 'https'
            for name, options in {
                    'DEFAULT': {'webserver_verify_ca': ca},
                    'deploy': {'image_server_auth_strategy': 'http_basic',
                               'image_server_user': AGENT_USER,
                               'image_server_password': password,
                               'image_server_auth_hosts': '127.0.0.1'},
                    'image_worker': {'image_server_auth': 'true'}}.items():
                ironic_options.setdefault(name, {}).update(options)
            with open(ca, 'rb') as f:
                self.vm_files = {
                    AGENT_CA: f.read(),
                    AGENT_CONF: ('[DEFAULT]\ncafile = %s\n'
                                 % AGENT_CA).encode()}
        elif self.kind == 'oci':
            worker_extra = '[oci]\npermit_fallback_to_http_transport = true\n'
        worker, own_root, ironic, self.master = services(
            self.transport, self.dir, self.opts.worker, self.cleanups,
            worker_http, ironic_options, worker_extra, scheme)
        return worker, own_root, ironic

    def _node(self, ironic, served):
        if self.opts.boot == 'redfish':
            node = self._redfish_node(ironic, served)
        else:
            node = ironic.node()
        checksum = ('0' * 64 if self.opts.break_ == 'checksum'
                    else file_hash(self.img))
        url = self.source.url(self.name)
        if self.kind == 'oci':
            url, checksum = self._push_oci(ironic, node), None
        ironic.call('PATCH', '/v1/nodes/%s' % node['uuid'], deploy_patch(
            self.transport, url, checksum))
        return node

    def _push_oci(self, ironic, node):
        """A registry (htpasswd) holding the image as ORAS pushes a disk,
        the node given its pull secret; returns the image's oci:// URL."""
        password = uuid.uuid4().hex
        registry = parts.Registry(os.path.join(self.dir, 'registry'),
                                       'robot', password)
        self.cleanups.append(registry.stop)
        registry.push_disk('vm/disk', 'v1', self.img, 'qcow2')
        ironic.call('PATCH', '/v1/nodes/%s' % node['uuid'], [
            {'op': 'add', 'path': '/driver_info/image_pull_secret',
             'value': 'robot:%s' % password},
            {'op': 'add', 'path': '/properties/cpu_arch',
             'value': 'x86_64'}])
        return registry.oci('vm/disk:v1')

    def _redfish_node(self, ironic, served):
        """--boot redfish: a libvirt domain behind sushy-tools, and its node
        on Ironic's ``redfish`` hardware type (tests/vm/redfish.py)."""
        mac = '52:54:00:%02x:%02x:%02x' % tuple(
            random.randrange(256) for _ in range(3))
        pool = redfish.Pool(self.dir)
        self.cleanups.append(pool.stop)
        self.machine = redfish.Machine(self.dir, mac, [ironic.port, served],
                                       DISK_SIZE, accelerator())
        self.cleanups.append(self.machine.remove)
        sushy = redfish.Sushy(self.dir, pool, [self.machine])
        self.cleanups.append(sushy.stop)
        params = agent_params(ironic.port, self.machine.agent_port,
                              self.machine.ports)
        return redfish.node(ironic, self.machine, sushy, self.opts.ramdisk,
                            mac, params, 'direct-worker')

    def _boot(self, node, ironic, served, vm=None):
        """The machine, as the deploy (or with ``vm``, a rebuild or the
        undeploy) starts: with fake power, a VM powered on as a BMC would
        (on the disk of ``vm``); with redfish, the domain Ironic powers on."""
        if self.opts.boot == 'redfish':
            self.machine.started = time.monotonic()
            return self.machine
        again = Vm(self.dir, self.opts.ramdisk, node['mac'], ironic.port,
                   [served], disk=vm.disk if vm else None,
                   files=self.vm_files)
        self.cleanups.append(again.stop)
        return again

    def _wait(self, ironic, worker, uuid_, vm, states):
        """Waits for the node to reach ``states[0]``; fails with what the
        VM, the worker and Ironic said when it reaches another."""
        try:
            done = ironic.wait(uuid_, states, self.opts.timeout)
        except AssertionError as e:
            raise AssertionError('%s: %s\n--- VM console:\n%s' % (
                self.kind, str(e).splitlines()[0], vm.tail()))
        if done['provision_state'] != states[0]:
            raise AssertionError(
                '%s: %s: %s\n--- VM console:\n%s\n--- worker:\n%s'
                '\n--- ironic:\n%s' % (
                    self.kind, done['provision_state'], done['last_error'],
                    vm.tail(), worker.tail() if worker else '',
                    ironic.tail(30)))
        return done

    def _run(self):
        worker, own_root, ironic = self._services()
        served = worker.http_port if worker else own_root.port
        node = self._node(ironic, served)
        uuid_ = node['uuid']
        if self.kind == 'worker-killed':
            # The download lasts seconds, so the worker dies inside it.
            self.source.throttle = 4 * MiB
            threading.Thread(target=self._kill_worker, daemon=True,
                             args=(worker,)).start()
        started = time.monotonic()
        ironic.provision(uuid_, 'active')
        vm = self._boot(node, ironic, served)
        log('%s: node %s deploying, VM on %s (agent at 127.0.0.1:%d)'
            % (self.kind, uuid_, vm.accel, vm.agent_port))
        if self.opts.break_ == 'wrong-file' and worker is not None:
            threading.Thread(target=self._swap_served, daemon=True,
                             args=(worker, uuid_)).start()
        self._wait(ironic, worker, uuid_, vm, ('active', 'deploy failed'))
        active = time.monotonic() - started
        off = vm.wait_off(180)
        log('%s: active after %.1fs, VM off after %.1fs'
            % (self.kind, active, off))
        check_disk(self.kind, vm.disk, self.ref)
        self._check_fetchers(worker, self.name, self.kind == 'oci')
        self._check_kind(worker)
        if self.opts.rebuild:
            self._rebuild(ironic, worker, node, vm, served)
        if self.opts.undeploy:
            self._undeploy(ironic, worker, node, vm, served)
        return {'kind': self.kind, 'active': active, 'off': off}

    def _kill_worker(self, worker):
        """worker-killed: SIGKILL once the worker has been downloading
        the source for a second, started again two seconds later."""
        self.source.requests.clear()
        deadline = time.monotonic() + 300
        while not self.source.gets(self.name):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(1)
        worker.kill()
        log('%s: the worker killed (SIGKILL) while downloading'
            % self.kind)
        time.sleep(2)
        self.source.throttle = 0
        worker.start()
        self.killed = time.monotonic()
        log('%s: the worker started again' % self.kind)

    def _check_kind(self, worker):
        """What only some scenarios check."""
        if self.kind == 'gzip-tls':
            gzip = worker.metric('http_response_encoding_bytes_total',
                                 'encoding="gzip"')
            identity = worker.metric('http_response_encoding_bytes_total',
                                     'encoding="identity"')
            size = os.path.getsize(self.ref)
            if not gzip or identity:
                raise AssertionError(
                    'gzip-tls: the image port sent %d bytes gzip and %d '
                    'identity: the agent did not take the compressed '
                    'image' % (gzip, identity))
            log('gzip-tls: the agent got the image over TLS and Basic '
                'auth, compressed: %d bytes for %d (%.3f)'
                % (gzip, size, gzip / size))
        if self.kind == 'worker-killed':
            if self.killed is None:
                raise AssertionError('worker-killed: the worker was never '
                                     'killed (no download seen)')
            log('worker-killed: the deploy completed with the worker '
                'killed during its download and started again')

    def _rebuild(self, ironic, worker, node, vm, served):
        """--rebuild: the active node rebuilt with another image (its agent
        boots again on the same disk); the disk then holds the other
        image, and the first image's master is still in the cache (within
        its size and TTL)."""
        uuid_ = node['uuid']
        img, ref = self.images.get('other', 58)
        name = os.path.basename(img)
        first = masters(worker)
        # The whole instance_info anew, as Metal3 sets it: Ironic wrote the
        # first deploy's served format (raw) into it.
        ironic.call('PATCH', '/v1/nodes/%s' % uuid_, deploy_patch(
            self.transport, self.source.url(name), file_hash(img)))
        started = time.monotonic()
        if self.opts.break_ == 'rebuild-wrong-file':
            threading.Thread(target=self._swap_served, daemon=True,
                             args=(worker, uuid_)).start()
        ironic.provision(uuid_, 'rebuild')
        again = self._boot(node, ironic, served, vm)
        self._wait(ironic, worker, uuid_, again, ('active', 'deploy failed'))
        again.wait_off(180)
        check_disk('%s: rebuild' % self.kind, vm.disk, ref)
        self._check_fetchers(worker, name, False)
        now = masters(worker)
        if len(first) != 1 or not set(first) < set(now) or len(now) != 2:
            raise AssertionError('%s: rebuild: masters %r before, %r after'
                                 % (self.kind, first, now))
        log('%s: rebuilt with another image in %.1fs (the disk holds it; '
            'both masters cached)' % (self.kind, time.monotonic() - started))

    def _undeploy(self, ironic, worker, node, vm, served):
        """Undeploy with automated cleaning: the machine boots its agent
        again (same disk), which erases the disk's metadata; the node is
        ``available`` again and the worker has dropped the node's file."""
        uuid_ = node['uuid']
        ironic.call('PATCH', '/v1/nodes/%s' % uuid_, [
            {'op': 'replace', 'path': '/automated_clean', 'value': True}])
        started = time.monotonic()
        ironic.provision(uuid_, 'deleted')
        again = self._boot(node, ironic, served, vm)
        self._wait(ironic, worker, uuid_, again, ('available',
                                                   'clean failed'))
        again.stop()
        with open(vm.disk, 'rb') as f:
            head = f.read(MiB)
        if head != bytes(MiB):
            raise AssertionError("%s: cleaning left the disk's first MiB"
                                 % self.kind)
        if worker is not None and os.path.lexists(
                os.path.join(worker.images_path, uuid_)):
            raise AssertionError("%s: the worker kept the node's file after "
                                 "the undeploy" % self.kind)
        log('%s: undeployed and cleaned back to available in %.1fs (disk '
            'metadata erased, node file gone)'
            % (self.kind, time.monotonic() - started))

    def _swap_served(self, worker, uuid_):
        """--break wrong-file: once the worker publishes the node's file,
        its bytes (and those of its compressed form) are overwritten
        before the agent fetches it."""
        link = os.path.join(worker.http_root, 'agent_images', uuid_)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if os.path.exists(link):
                compressed = os.path.join(worker.masters, '.gzip', '*.gz')
                if self.kind == 'gzip-tls':
                    # Compressed once published; waits for it.
                    while not glob.glob(compressed):
                        time.sleep(0.1)
                for path in [link] + glob.glob(compressed):
                    with open(path, 'r+b') as f:
                        f.seek(MiB)
                        f.write(b'\xa5' * MiB)
                log('break: the served file of %s overwritten' % uuid_)
                return
            time.sleep(0.1)

    def _check_fetchers(self, worker, name, registry):
        """Who fetched the image: ``name`` from the source, or with
        ``registry`` the scenario's from its registry."""
        agents = self.source.gets(name)
        self.source.requests.clear()
        master = os.listdir(self.master) if os.path.isdir(self.master) else []
        if worker is not None and master:
            raise AssertionError("%s: Ironic's master image cache holds %r"
                                 % (self.kind, master))
        if registry:
            # Ironic's OCI client would have written a master too.
            if not worker.metric('download_bytes_total'):
                raise AssertionError('oci: the worker downloaded nothing')
            log('oci: the worker pulled the image from the registry; '
                'Ironic cached nothing')
            return
        if worker is None:
            # The control: stock Ironic downloads the source itself.
            if not agents or any(a.startswith(WORKER_AGENT) for a in agents):
                raise AssertionError('direct: source GETs by %r' % agents)
            log('direct: Ironic fetched the source (%s)' % agents)
            return
        if not agents or not all(a.startswith(WORKER_AGENT) for a in agents):
            raise AssertionError('%s: the source was fetched by %r, not only '
                                 'the worker' % (self.kind, agents))
        log('%s: only the worker fetched the source (%s); Ironic cached '
            'nothing' % (self.kind, agents))


def masters(worker):
    """The names of the worker's masters."""
    return sorted(n for n in os.listdir(worker.masters)
                  if not n.startswith('.'))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--worker', required=True,
                        help='the ironic-image-worker binary')
    parser.add_argument('--ramdisk', required=True,
                        help='directory with vmlinuz and initramfs')
    parser.add_argument('--workdir', default='/var/tmp',
                        help='where the VMs disks and images are made')
    parser.add_argument('--break', dest='break_',
                        choices=('wrong-file', 'checksum',
                                 'rebuild-wrong-file'))
    parser.add_argument('--boot', choices=('fake', 'redfish'),
                        default='fake',
                        help='fake power and a VM the harness starts, or '
                        'redfish power and virtual media through sushy-tools '
                        '(tests/vm/redfish.py)')
    parser.add_argument('--rebuild', action='store_true',
                        help='then rebuild with another image (a second '
                        'boot)')
    parser.add_argument('--undeploy', action='store_true',
                        help='then undeploy with cleaning (a second boot)')
    parser.add_argument('--timeout', type=int, default=780,
                        help='seconds a deploy may take')
    parser.add_argument('--image-mib', type=int, default=32,
                        help='MiB of data in the source image')
    parser.add_argument('--virtual-mib', type=int, default=512,
                        help='virtual size of the source image, MiB')
    parser.add_argument('scenarios', nargs='+', choices=sorted(TRANSPORT))
    opts = parser.parse_args()
    if opts.boot == 'redfish':
        if 'gzip-tls' in opts.scenarios:
            parser.error('gzip-tls boots the ramdisk with its CA: --boot fake')
        redfish.check_ready()
    # Stopped from outside (the test's last-resort timeout): the cleanups
    # still stop Ironic, the worker and the VMs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix='iiw-vm-', dir=opts.workdir)
    os.makedirs(os.path.join(workdir, 'src'))
    source = Source(os.path.join(workdir, 'src'))
    passed = failed = 0
    try:
        images = Images(workdir, opts)
        for kind in opts.scenarios:
            try:
                Scenario(kind, opts, workdir, source, images).run()
                passed += 1
                log('%s: PASSED' % kind)
            except Exception as e:  # noqa: each scenario is reported
                failed += 1
                log('%s: FAILED: %s' % (kind, e))
    finally:
        source.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print('%d passed, %d failed' % (passed, failed), flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
