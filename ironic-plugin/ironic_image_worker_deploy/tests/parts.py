# Licensed under the Apache License, Version 2.0 (the "License"); you may
# not use this file except in compliance with the License. You may obtain
# a copy of the License at
#
#      http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS, WITHOUT
# WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied. See the
# License for the specific language governing permissions and limitations
# under the License.

"""Real parts for the deploy interface tests: an HTTP image source that
counts downloads, a Glance Image API v2 server, a spare worker process, and
reference tools (qemu-img, hashlib)."""

import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid


def env(name, default=None):
    """A parameter passed by the cargo test (tests/it/ironic_plugin.rs)."""
    return os.environ.get(name, default)


class _Server(object):
    """An HTTP server on a thread, counting requests per (method, path)."""

    def __init__(self, handler_class, port=0):
        self.counts = {}
        outer = self

        class Handler(handler_class):
            server_owner = outer

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', port),
                                                     Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       daemon=True)
        self.thread.start()

    def count(self, method, path):
        return self.counts.get((method, path), 0)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _Counting(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def _count(self):
        key = (self.command, self.path)
        owner = self.server_owner
        owner.counts[key] = owner.counts.get(key, 0) + 1

    def _send_file(self, path, content_type='application/octet-stream',
                   body=True):
        try:
            size = os.path.getsize(path)
        except OSError:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header('Content-Type', content_type)
        self.send_header('Content-Length', str(size))
        self.send_header('Last-Modified',
                         self.date_time_string(os.path.getmtime(path)))
        self.end_headers()
        if body:
            with open(path, 'rb') as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _send_json(self, doc):
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class SourceServer(_Server):
    """Serves the files of a directory by name; counts GETs. A GET of a
    gated name waits for its gate to open (at most a minute)."""

    def __init__(self, directory):
        self.directory = directory
        self.gates = {}
        gates = self.gates

        class Handler(_Counting):
            def do_GET(self):
                self._count()
                gate = gates.get(self.path.lstrip('/'))
                if gate is not None:
                    gate.wait(60)
                self._send_file(os.path.join(directory,
                                             self.path.lstrip('/')))

            def do_HEAD(self):
                self._count()
                self._send_file(os.path.join(directory,
                                             self.path.lstrip('/')),
                                body=False)

        super().__init__(Handler)

    def url(self, name):
        return 'http://127.0.0.1:%d/%s' % (self.port, name)

    def gate(self, name):
        """GETs of ``name`` wait until the returned event is set."""
        self.gates[name] = threading.Event()
        return self.gates[name]


class GlanceServer(_Server):
    """The part of Glance's Image API v2 that Ironic and the worker call."""

    def __init__(self, port=0):
        self.images = {}
        images = self.images

        class Handler(_Counting):
            def do_GET(self):
                self._count()
                path = self.path.rstrip('/')
                base = 'http://127.0.0.1:%d/image' % self.server_owner.port
                if path in ('/image', '/image/v2'):
                    self._send_json({'versions': [{
                        'id': 'v2.16', 'status': 'CURRENT',
                        'links': [{'rel': 'self',
                                   'href': base + '/v2/'}]}]})
                    return
                parts = path.split('/')
                # /image/v2/images/<id>[/file]
                if len(parts) >= 5 and parts[1:4] == ['image', 'v2',
                                                      'images']:
                    found = images.get(parts[4])
                    if found is None:
                        self.send_error(404)
                    elif len(parts) == 5:
                        self._send_json(found[0])
                    elif parts[5:] == ['file']:
                        self._send_file(found[1])
                    else:
                        self.send_error(404)
                    return
                self.send_error(404)

        super().__init__(Handler, port)

    def add(self, path, disk_format, **properties):
        """Registers ``path`` as an active public image; returns its id."""
        image_id = str(uuid.uuid4())
        doc = {
            'id': image_id, 'name': 'test-image', 'status': 'active',
            'disk_format': disk_format, 'container_format': 'bare',
            'checksum': file_hash(path, 'md5'),
            'os_hash_algo': 'sha512',
            'os_hash_value': file_hash(path, 'sha512'),
            'size': os.path.getsize(path),
            'created_at': '2026-11-30T05:00:00Z',
            'updated_at': '2026-11-30T05:00:00Z',
            'visibility': 'public', 'protected': False,
            'min_disk': 0, 'min_ram': 0, 'tags': ['tested'],
            'owner': 'service',
            'file': '/v2/images/%s/file' % image_id,
            'self': '/v2/images/%s' % image_id,
            'schema': '/v2/schemas/image',
        }
        doc.update(properties)
        self.images[image_id] = (doc, path)
        return image_id

    def data_gets(self, image_id):
        return self.count('GET', '/image/v2/images/%s/file' % image_id)


def file_hash(path, algo):
    h = hashlib.new(algo)
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            h.update(chunk)
    return h.hexdigest()


def run(*args):
    """Runs a reference tool; fails loudly."""
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)


def patchy_raw(path, size, seed):
    """A sparse raw disk with random data at a few places, zeros elsewhere
    (as the Rust tests make them)."""
    import random
    rnd = random.Random(seed)
    chunk = bytes(rnd.getrandbits(8) for _ in range(64 * 1024 + 17))
    with open(path, 'wb') as f:
        f.truncate(size)
        for i, at in enumerate((0, size // 3, size // 2 + 4096,
                                size - 70000)):
            f.seek(min(at, size - len(chunk)))
            f.write(chunk[:len(chunk) - i])


def qcow2_from(raw, out):
    run('qemu-img', 'convert', '-f', 'raw', '-O', 'qcow2', raw, out)


def reference_raw(qcow2, out):
    """``qemu-img convert -O raw``: the reference for conversion results."""
    run('qemu-img', 'convert', '-f', 'qcow2', '-O', 'raw', qcow2, out)


def ipa_download(image_info, workdir):
    """Downloads with ironic-python-agent's own code (standby extension:
    ``_validate_image_info`` and ``_download_image``, which verifies
    ``os_hash_value`` or the checksum), in a process of its own so IPA's
    configuration stays apart from Ironic's. Returns the file's path."""
    info_path = os.path.join(workdir, 'image_info-%s.json' % uuid.uuid4())
    with open(info_path, 'w') as f:
        json.dump(image_info, f)
    out = subprocess.run(
        [sys.executable, '-m',
         'ironic_image_worker_deploy.tests.ipa_download', info_path,
         workdir], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=120)
    if out.returncode != 0:
        raise AssertionError('IPA download failed:\n%s'
                             % out.stdout.decode(errors='replace'))
    return os.path.join(workdir, image_info['id'])


class SpareWorker(object):
    """A second worker (its own host and directories), started and stopped
    by a test."""

    def __init__(self, binary, config, metrics_port, environ=None):
        self.binary = binary
        self.config = config
        self.metrics_port = metrics_port
        # Further variables of its environment (options set by a test).
        self.environ = environ or {}
        self.proc = None

    def start(self):
        environ = dict(os.environ, RUST_LOG='warn,lapin=error',
                       **self.environ)
        environ.pop('IRONIC_IMAGE_WORKER_CONFIG', None)
        self.proc = subprocess.Popen(
            [self.binary, '--config', self.config, 'serve'],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            env=environ)
        url = 'http://127.0.0.1:%d/readyz' % self.metrics_port
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError('spare worker exited with %s'
                                     % self.proc.returncode)
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError('spare worker did not become ready')

    def kill(self):
        """Stops it at once (SIGKILL): its unfinished work goes back to
        its queue."""
        self.proc.kill()
        self.proc.wait()

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def broker_connections(text):
    """(pid, heartbeat timeout) of the default RabbitMQ node's connections
    whose client properties contain ``text`` (``rabbitmqctl``)."""
    out = subprocess.run(
        ['rabbitmqctl', '-q', 'list_connections', '--no-table-headers',
         'pid', 'timeout', 'client_properties'],
        check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        timeout=60).stdout.decode()
    found = []
    for line in out.splitlines():
        fields = line.split('\t')
        if len(fields) >= 3 and text in fields[2]:
            found.append((fields[0], int(fields[1])))
    return found


def close_broker_connection(pid):
    """Closes one connection from the broker side, as a node going away
    would (``rabbitmqctl close_connection``)."""
    run('rabbitmqctl', '-q', 'close_connection', pid, 'closed by the test')


class Registry(object):
    """Debian's ``docker-registry`` (the CNCF distribution registry) on a
    port of its own, its storage under ``directory``, plain HTTP, with
    htpasswd (Basic) authentication for ``user``. Artifacts are pushed
    with the registry's upload API, laid out as ORAS pushes a disk image
    (one layer, tagged under an index whose entry names the disktype and
    the platform)."""

    def __init__(self, directory, user, password):
        import base64
        import socket
        os.makedirs(directory, exist_ok=True)
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            self.port = s.getsockname()[1]
        line = subprocess.run(['htpasswd', '-Bbn', user, password],
                              check=True, stdout=subprocess.PIPE).stdout
        htpasswd = os.path.join(directory, 'htpasswd')
        with open(htpasswd, 'wb') as f:
            f.write(line.strip())
        config = os.path.join(directory, 'config.yml')
        with open(config, 'w') as f:
            f.write('version: 0.1\nlog:\n  level: warn\n  accesslog:\n'
                    '    disabled: true\nstorage:\n  filesystem:\n'
                    '    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%d\n'
                    'auth:\n  htpasswd:\n    realm: iiw-test\n'
                    '    path: %s\n'
                    % (os.path.join(directory, 'storage'), self.port,
                       htpasswd))
        self._auth = 'Basic ' + base64.b64encode(
            ('%s:%s' % (user, password)).encode()).decode()
        self.proc = subprocess.Popen(
            ['/usr/bin/docker-registry', 'serve', config],
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(directory, 'registry.log'), 'wb'))
        for _ in range(100):
            try:
                urllib.request.urlopen(self._url(''), timeout=2)
            except urllib.error.HTTPError:
                return   # 401: up
            except OSError:
                time.sleep(0.1)
        raise AssertionError('the registry did not start')

    def _url(self, path):
        return 'http://127.0.0.1:%d/v2/%s' % (self.port, path)

    def oci(self, rest):
        """``oci://127.0.0.1:<port>/<rest>``."""
        return 'oci://127.0.0.1:%d/%s' % (self.port, rest)

    def _call(self, method, url, data=None, content_type=None):
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header('Authorization', self._auth)
        if content_type:
            req.add_header('Content-Type', content_type)
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers

    def blob(self, repo, data):
        digest = 'sha256:' + hashlib.sha256(data).hexdigest()
        status, headers = self._call('POST',
                                     self._url(repo + '/blobs/uploads/'))
        assert status == 202, status
        loc = urllib.parse.urljoin(self._url(''), headers['Location'])
        sep = '&' if '?' in loc else '?'
        status, _ = self._call('PUT', '%s%sdigest=%s' % (loc, sep, digest),
                               data, 'application/octet-stream')
        assert status == 201, status
        return digest

    def manifest(self, repo, reference, doc, media_type):
        body = json.dumps(doc).encode()
        digest = 'sha256:' + hashlib.sha256(body).hexdigest()
        status, _ = self._call(
            'PUT', self._url('%s/manifests/%s' % (repo, reference or digest)),
            body, media_type)
        assert status == 201, status
        return digest, len(body)

    def push_disk(self, repo, tag, path, disktype, arch='amd64'):
        """Pushes ``path`` as a one-layer artifact tagged ``tag`` through an
        index; returns the artifact manifest's digest."""
        with open(path, 'rb') as f:
            data = f.read()
        layer = self.blob(repo, data)
        config = self.blob(repo, b'{}')
        manifest = 'application/vnd.oci.image.manifest.v1+json'
        digest, size = self.manifest(repo, None, {
            'schemaVersion': 2, 'mediaType': manifest,
            'artifactType': 'application/vnd.unknown.artifact.v1',
            'config': {'mediaType': 'application/vnd.oci.empty.v1+json',
                       'digest': config, 'size': 2},
            'layers': [{'mediaType': 'application/octet-stream',
                        'digest': layer, 'size': len(data),
                        'annotations': {'org.opencontainers.image.title':
                                        os.path.basename(path)}}]},
            manifest)
        index = 'application/vnd.oci.image.index.v1+json'
        self.manifest(repo, tag, {
            'schemaVersion': 2, 'mediaType': index,
            'manifests': [{'mediaType': manifest, 'digest': digest,
                           'size': size,
                           'platform': {'architecture': arch,
                                        'os': 'linux'},
                           'annotations': {'disktype': disktype}}]},
            index)
        return digest

    def stop(self):
        self.proc.kill()
        self.proc.wait()
