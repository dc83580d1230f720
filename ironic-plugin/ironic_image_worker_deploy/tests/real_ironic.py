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

"""A whole Ironic 39 (``ironic``: API and conductor in one process, its own
sqlite database) and an agent double that boots, looks up, heartbeats and
answers the commands Ironic sends an ironic-python-agent during a direct
deploy, writing the image to a file as the agent writes it to a disk."""

import hashlib
import http.server
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

_API_VERSION = '1.96'


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Ironic(object):
    """``ironic`` (API and conductor) with ``sections`` in its ironic.conf."""

    def __init__(self, workdir, sections, env_sections=None):
        """``sections`` go into ironic.conf, ``env_sections`` into
        ``OS_<GROUP>__<OPTION>`` variables (as Metal3 configures Ironic)."""
        self.dir = tempfile.mkdtemp(prefix='ironic-', dir=workdir)
        self.port = free_port()
        base = {
            'DEFAULT': {
                'auth_strategy': 'noauth',
                'rpc_transport': 'none',
                'host': 'conductor-%s' % uuid.uuid4().hex[:8],
                'enabled_hardware_types': 'fake-hardware',
                'enabled_deploy_interfaces': 'direct-worker,fake',
                'enabled_boot_interfaces': 'fake',
                'enabled_power_interfaces': 'fake',
                # Fake management refuses the disk boot device that the
                # deploy's last steps set.
                'enabled_management_interfaces': 'fake,noop',
                'enabled_network_interfaces': 'noop',
                'enabled_inspect_interfaces': 'no-inspect',
                'enabled_raid_interfaces': 'no-raid',
                'enabled_vendor_interfaces': 'no-vendor',
                'enabled_storage_interfaces': 'noop',
                'enabled_bios_interfaces': 'no-bios',
                'enabled_console_interfaces': 'no-console',
                'enabled_firmware_interfaces': 'no-firmware',
                'enabled_rescue_interfaces': 'no-rescue',
                'use_stderr': 'true',
                'debug': 'false',
            },
            'api': {'host_ip': '127.0.0.1', 'port': str(self.port)},
            # The API URL the agent is told (Metal3 sets it likewise).
            'service_catalog': {'endpoint_override':
                                'http://127.0.0.1:%d' % self.port},
            'database': {'connection': 'sqlite:///%s/ironic.sqlite'
                         % self.dir},
            'conductor': {'automated_clean': 'false',
                          'sync_power_state_interval': '-1',
                          'check_provision_state_interval': '5'},
            'agent': {'require_tls': 'false',
                      'post_deploy_get_power_state_retries': '1',
                      'post_deploy_get_power_state_retry_interval': '1',
                      'deploy_logs_collect': 'never'},
            'oslo_concurrency': {'lock_path': self.dir},
        }
        for name, options in sections.items():
            base.setdefault(name, {}).update(options)
        self.conf = os.path.join(self.dir, 'ironic.conf')
        with open(self.conf, 'w') as f:
            for name, options in base.items():
                f.write('[%s]\n' % name)
                for key, value in options.items():
                    f.write('%s = %s\n' % (key, value))
        bindir = os.path.dirname(sys.executable)
        subprocess.run([os.path.join(bindir, 'ironic-dbsync'),
                        '--config-file', self.conf, 'create_schema'],
                       check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        self.log = open(os.path.join(self.dir, 'ironic.log'), 'wb')
        environ = dict(os.environ)
        for group, options in (env_sections or {}).items():
            for key, value in options.items():
                environ['OS_%s__%s' % (group.upper(), key.upper())] = value
        self.proc = subprocess.Popen(
            [os.path.join(bindir, 'ironic'), '--config-file', self.conf],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            env=environ)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise AssertionError('ironic exited:\n%s' % self.tail())
            try:
                self.call('GET', '/v1/drivers')
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError('ironic did not start:\n%s'
                                         % self.tail())
                time.sleep(0.2)

    def tail(self, n=60):
        """The last lines of Ironic's log, its API's GETs left out."""
        with open(os.path.join(self.dir, 'ironic.log'), 'rb') as f:
            lines = [line for line in f.read().splitlines()
                     if b' - GET /v1/' not in line]
        return b'\n'.join(lines[-n:]).decode(errors='replace')

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            'http://127.0.0.1:%d%s' % (self.port, path), data=data,
            method=method)
        req.add_header('Content-Type', 'application/json')
        req.add_header('X-OpenStack-Ironic-API-Version', _API_VERSION)
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def node(self, **fields):
        """A node on fake-hardware with direct-worker and one port."""
        body = dict(driver='fake-hardware', deploy_interface='direct-worker',
                    management_interface='noop', **fields)
        node = self.call('POST', '/v1/nodes', body)
        mac = '52:54:00:%02x:%02x:%02x' % tuple(
            random.randrange(256) for _ in range(3))
        self.call('POST', '/v1/ports', {'node_uuid': node['uuid'],
                                        'address': mac})
        for target in ('manage', 'provide'):
            self.provision(node['uuid'], target)
            self.wait(node['uuid'], ('manageable', 'available'), 60)
        node['mac'] = mac
        return node

    def provision(self, uuid_, target):
        self.call('PUT', '/v1/nodes/%s/states/provision' % uuid_,
                  {'target': target})

    def get(self, uuid_):
        return self.call('GET', '/v1/nodes/%s' % uuid_)

    def wait(self, uuid_, states, within, agent=None):
        deadline = time.monotonic() + within
        while True:
            node = self.get(uuid_)
            if node['provision_state'] in states:
                return node
            if time.monotonic() > deadline:
                raise AssertionError(
                    'node %s is %s (%s), not in %s; agent: %s\n%s' % (
                        uuid_, node['provision_state'], node['last_error'],
                        states, agent and agent.errors, self.tail()))
            time.sleep(0.2)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Agent(object):
    """An ironic-python-agent double for the nodes of ``ironic``: once a
    node waits for its agent, it "boots" for ``boot_seconds``, looks itself
    up, then heartbeats every ``interval`` until the node is active or
    failed; it runs the commands Ironic sends (``write_image`` downloads the
    image URL and writes it to ``disk(node)``)."""

    def __init__(self, ironic, workdir, boot_seconds=1.0, interval=1.0):
        self.ironic = ironic
        self.dir = tempfile.mkdtemp(prefix='agent-', dir=workdir)
        self.boot_seconds = boot_seconds
        self.interval = interval
        self.commands = {}
        self.booted_at = {}
        self.image_infos = {}
        self.errors = []
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = 'HTTP/1.1'

            def log_message(self, *args):
                pass

            def _node(self):
                return self.path.strip('/').split('/')[0]

            def _json(self, doc):
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._json({'commands': agent.commands.get(self._node(),
                                                           [])})

            def do_POST(self):
                length = int(self.headers.get('Content-Length', 0))
                body = json.loads(self.rfile.read(length) or b'{}')
                self._json(agent.run(self._node(), body['name'],
                                     body.get('params') or {}))

        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                                     Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever,
                         daemon=True).start()

    def disk(self, node_uuid):
        return os.path.join(self.dir, '%s.disk' % node_uuid)

    def run(self, node, name, params):
        """One command, done at once (its result kept for the status)."""
        result = {}
        status = 'SUCCEEDED'
        error = None
        if name == 'deploy.get_deploy_steps':
            result = {'deploy_steps': {'GenericHardwareManager': [
                {'step': 'write_image', 'priority': 0,
                 'interface': 'deploy', 'reboot_requested': False,
                 'abortable': False, 'argsinfo': None}]},
                'hardware_manager_version': {'generic': '1'}}
        elif name == 'deploy.execute_deploy_step':
            step = params['step']
            if step['step'] == 'write_image':
                try:
                    self.write_image(node, step['args']['image_info'])
                except Exception as e:  # noqa: reported as the agent does
                    status, error = 'FAILED', str(e)
            result = {'deploy_step': step, 'deploy_result': None}
        command = {'id': str(uuid.uuid4()),
                   'command_name': name.split('.', 1)[-1],
                   'command_status': status, 'command_result': result,
                   'command_error': error}
        self.commands.setdefault(node, []).append(command)
        return command

    def write_image(self, node, image_info):
        """Download, verify the announced hash and write, as the agent."""
        self.image_infos[node] = image_info
        algo = image_info.get('os_hash_algo') or 'md5'
        expected = image_info.get('os_hash_value') or image_info['checksum']
        digest = hashlib.new(algo)
        req = urllib.request.Request(image_info['urls'][0])
        with urllib.request.urlopen(req, timeout=120) as resp, \
                open(self.disk(node), 'wb') as out:
            for chunk in iter(lambda: resp.read(1 << 20), b''):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != expected:
            raise ValueError('image checksum mismatch')

    def boot(self, node):
        """Runs the node's ramdisk on a thread: waits for the deploy to
        wait for it, boots, looks up, heartbeats until the deploy ends."""
        thread = threading.Thread(target=self._life, args=(node,),
                                  daemon=True)
        thread.start()
        return thread

    def _life(self, node):
        try:
            self._live(node)
        except Exception as e:  # noqa: shown by the test that waits
            self.errors.append('%s: %r' % (node['uuid'], e))
            raise

    def _live(self, node):
        uuid_ = node['uuid']
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            state = self.ironic.get(uuid_)['provision_state']
            if state == 'wait call-back':
                break
            if state in ('deploy failed', 'active'):
                return
            time.sleep(0.1)
        time.sleep(self.boot_seconds)
        self.booted_at[uuid_] = time.monotonic()
        while True:
            try:
                found = self.ironic.call(
                    'GET', '/v1/lookup?node_uuid=%s&addresses=%s'
                    % (uuid_, node['mac']))
                break
            except urllib.error.HTTPError as e:
                # 409: the node is locked (the conductor still works on
                # it); the agent looks up again.
                if e.code != 409 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        token = found['config']['agent_token']
        while time.monotonic() < deadline:
            try:
                self.ironic.call('POST', '/v1/heartbeat/%s' % uuid_, {
                    'callback_url': 'http://127.0.0.1:%d/%s'
                                    % (self.port, uuid_),
                    'agent_token': token, 'agent_version': '13.0.0'})
            except urllib.error.HTTPError as e:
                # 409: the node is locked, next time; anything else is
                # the deploy's failure, seen by the test.
                if e.code != 409:
                    self.errors.append('%s: heartbeat %s' % (uuid_, e))
            state = self.ironic.get(uuid_)['provision_state']
            if state in ('active', 'deploy failed'):
                return
            time.sleep(self.interval)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)
