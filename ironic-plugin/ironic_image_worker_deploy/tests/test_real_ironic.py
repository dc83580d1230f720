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

"""Deploys through a whole Ironic 39 without a broker, shaped as Metal3
runs it: ``ironic`` (API and conductor in one process) with
``rpc_transport = none`` (and again with ``json-rpc``), nodes on
``direct-worker`` with ``image_download_source = local`` in their
``instance_info``, ``[image_worker]transport = json-rpc`` to a worker whose
AMQP is off (TLS with a CA, HTTP Basic), and an agent double that writes
the image it is given to a file (see real_ironic.py)."""

import os
import shutil
import tempfile
import threading
import time
import unittest

from ironic_image_worker_deploy.tests import parts
from ironic_image_worker_deploy.tests import real_ironic


def _worker_sections(password=None, port=None):
    env = parts.env
    return {
        'deploy': {'http_url': 'http://127.0.0.1:%s'
                               % env('IIW_RPC_HTTP_PORT'),
                   'http_root': env('IIW_RPC_HTTP_ROOT')},
        'pxe': {'images_path': env('IIW_RPC_IMAGES_PATH')},
        'image_worker': {'transport': 'json-rpc', 'prepare_timeout': '60',
                         'poll_interval': '0.5'},
        'image_worker_json_rpc': {
            'host_ip': '127.0.0.1', 'port': port or env('IIW_RPC_PORT'),
            'auth_strategy': 'http_basic', 'auth_type': 'http_basic',
            'username': env('IIW_RPC_USER'),
            'password': password or env('IIW_RPC_PASSWORD'),
            'use_ssl': 'true', 'cafile': env('IIW_RPC_CA')},
    }


class RealIronicTestCase(unittest.TestCase):
    """A Metal3-shaped Ironic deploys through the worker end to end."""

    @classmethod
    def setUpClass(cls):
        if not parts.env('IIW_RPC_PORT'):
            raise unittest.SkipTest('run through cargo test --test it '
                                    'ironic_plugin::')
        cls.dir = tempfile.mkdtemp(prefix='iiw-real-ironic-')
        os.makedirs(os.path.join(cls.dir, 'src'))
        cls.source = parts.SourceServer(os.path.join(cls.dir, 'src'))

    @classmethod
    def tearDownClass(cls):
        cls.source.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def _ironic(self, sections, env_sections=None):
        ironic = real_ironic.Ironic(self.dir, sections, env_sections)
        self.addCleanup(ironic.stop)
        agent = real_ironic.Agent(ironic, self.dir)
        self.addCleanup(agent.stop)
        return ironic, agent

    def _image(self, name, size=16 << 20, seed=1):
        """(qcow2 in the source, its qemu-img convert reference)."""
        raw = os.path.join(self.dir, name + '.raw')
        parts.patchy_raw(raw, size, seed)
        img = os.path.join(self.dir, 'src', name + '.qcow2')
        parts.qcow2_from(raw, img)
        ref = os.path.join(self.dir, name + '.ref')
        parts.reference_raw(img, ref)
        return img, ref

    def _deploy(self, ironic, agent, name, img, sha=None):
        """A node deployed with ``name``'s image (started, not awaited)."""
        node = ironic.node()
        ironic.call('PATCH', '/v1/nodes/%s' % node['uuid'], [
            {'op': 'add', 'path': '/instance_info', 'value': {
                'image_source': self.source.url(name + '.qcow2'),
                'image_os_hash_algo': 'sha256',
                'image_os_hash_value': sha or parts.file_hash(img, 'sha256'),
                'image_disk_format': 'qcow2',
                'image_download_source': 'local'}}])
        agent.boot(node)
        ironic.provision(node['uuid'], 'active')
        return node

    def _link(self, node):
        return os.path.join(parts.env('IIW_RPC_HTTP_ROOT'), 'agent_images',
                            node['uuid'])

    def test_deploy_deployed_undeploy_one_download_and_a_mismatch(self):
        ironic, agent = self._ironic(_worker_sections())
        img, ref = self._image('real', seed=31)
        node = self._deploy(ironic, agent, 'real', img)
        done = ironic.wait(node['uuid'], ('active', 'deploy failed'), 300, agent)
        self.assertEqual('active', done['provision_state'], done['last_error'])
        # The agent wrote exactly qemu-img's conversion, from the worker.
        self.assertEqual(parts.file_hash(ref, 'sha256'),
                         parts.file_hash(agent.disk(node['uuid']), 'sha256'))
        info = agent.image_infos[node['uuid']]
        self.assertEqual(['%s/agent_images/%s'
                          % (_worker_sections()['deploy']['http_url'],
                             node['uuid'])], info['urls'])
        # deployed: the worker withdrew the node's URL.
        self.assertFalse(os.path.lexists(self._link(node)))
        # Undeploy goes through clean_up (cleanup).
        ironic.provision(node['uuid'], 'deleted')
        ironic.wait(node['uuid'], ('available',), 120)

        # Two nodes, one image: one download.
        img2, ref2 = self._image('shared', seed=32)
        nodes = [self._deploy(ironic, agent, 'shared', img2)
                 for _ in range(2)]
        for n in nodes:
            done = ironic.wait(n['uuid'], ('active', 'deploy failed'), 300, agent)
            self.assertEqual('active', done['provision_state'],
                             done['last_error'])
            self.assertEqual(parts.file_hash(ref2, 'md5'),
                             parts.file_hash(agent.disk(n['uuid']), 'md5'))
        self.assertEqual(1, self.source.count('GET', '/shared.qcow2'))

        # A checksum mismatch fails the deploy with the worker's code.
        liar = self._deploy(ironic, agent, 'real', img, sha='0' * 64)
        done = ironic.wait(liar['uuid'], ('active', 'deploy failed'), 300, agent)
        self.assertEqual('deploy failed', done['provision_state'])
        self.assertIn('checksum_mismatch', done['last_error'])
        self.assertFalse(os.path.lexists(self._link(liar)))

    def test_wrong_password_fails_naming_the_options(self):
        ironic, agent = self._ironic(_worker_sections(password='wrong'))
        img, _ = self._image('pw', size=4 << 20, seed=33)
        node = self._deploy(ironic, agent, 'pw', img)
        done = ironic.wait(node['uuid'], ('active', 'deploy failed'), 120, agent)
        self.assertEqual('deploy failed', done['provision_state'])
        self.assertIn('[image_worker_json_rpc]', done['last_error'])
        self.assertIn('http_basic_auth_user_file', done['last_error'])

    def test_worker_down_fails_within_the_prepare_timeout(self):
        ironic, agent = self._ironic(
            _worker_sections(port=str(real_ironic.free_port())))
        img, _ = self._image('down', size=4 << 20, seed=34)
        started = time.monotonic()
        node = self._deploy(ironic, agent, 'down', img)
        done = ironic.wait(node['uuid'], ('active', 'deploy failed'), 120, agent)
        self.assertEqual('deploy failed', done['provision_state'])
        self.assertIn('no_worker', done['last_error'])
        self.assertLess(time.monotonic() - started, 60)

    def test_with_ironics_own_json_rpc(self):
        # The interface's options as Metal3 gives them: OS_<GROUP>__<OPTION>
        # variables, none in ironic.conf.
        worker = _worker_sections()
        env_sections = {g: worker.pop(g)
                        for g in ('image_worker', 'image_worker_json_rpc')}
        sections = worker
        # The API reaches the conductor at its [DEFAULT]host (Metal3 sets
        # the pod's address).
        sections['DEFAULT'] = {'rpc_transport': 'json-rpc',
                               'host': '127.0.0.1'}
        sections['json_rpc'] = {'host_ip': '127.0.0.1',
                                'port': str(real_ironic.free_port()),
                                'auth_strategy': 'noauth'}
        ironic, agent = self._ironic(sections, env_sections)
        img, ref = self._image('ownrpc', size=8 << 20, seed=35)
        node = self._deploy(ironic, agent, 'ownrpc', img)
        done = ironic.wait(node['uuid'], ('active', 'deploy failed'), 300, agent)
        self.assertEqual('active', done['provision_state'], done['last_error'])
        self.assertEqual(parts.file_hash(ref, 'md5'),
                         parts.file_hash(agent.disk(node['uuid']), 'md5'))
