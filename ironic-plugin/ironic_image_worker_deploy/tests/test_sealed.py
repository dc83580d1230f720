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

"""Sealed commands and answers, with the real deploy interface in Ironic 39,
the real broker and the worker binary (started here with its seal options
in its environment, by tests/it/sealed.rs's driver).

Forged and unsealed answers published ahead of the worker's own are skipped
and the genuine prepare completes; a key rotation and a rolling upgrade
lose no prepare.
"""

import json
import os

import fixtures as fx
import kombu

from ironic.conf import CONF
from oslo_utils import uuidutils

from ironic_image_worker_deploy import client as worker_client
from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy import seal
from ironic_image_worker_deploy.tests import parts
from ironic_image_worker_deploy.tests import test_deploy

setUpModule = test_deploy.setUpModule
tearDownModule = test_deploy.tearDownModule

OLD = bytes(range(32))
NEW = bytes(range(100, 132))
STRANGER = bytes(range(200, 232))

_OPTION = 'IRONIC_IMAGE_WORKER__AMQP__'


class SealedDeployTestCase(test_deploy._DeployCase):
    """The worker of IIW_WORKER_HOST, started by each case with its seal
    settings; the interface configured with its own."""

    def setUp(self):
        super().setUp()
        self.keys = self.useFixture(fx.TempDir()).path

    def _key_file(self, name, *keys):
        path = os.path.join(self.keys, name)
        with open(path, 'w') as f:
            f.write(''.join(k.hex() + '\n' for k in keys))
        os.chmod(path, 0o600)
        return path

    def _worker(self, key_file=None, mode=None):
        """The worker (re)started with ``[amqp]seal_secret_file`` and
        ``seal`` (unset when None)."""
        environ = {}
        if key_file:
            environ[_OPTION + 'SEAL_SECRET_FILE'] = key_file
        if mode:
            environ[_OPTION + 'SEAL'] = mode
        worker = parts.SpareWorker(
            parts.env('IIW_WORKER_BIN'), parts.env('IIW_SEALED_CONFIG'),
            int(parts.env('IIW_SEALED_METRICS_PORT')), environ)
        worker.start()
        self.addCleanup(worker.stop)
        return worker

    def _interface(self, key_file=None, mode=None):
        self.config(seal_secret_file=key_file, seal=mode,
                    group='image_worker')

    def _deployed(self, name, seed):
        """A prepare of a new image for a new node, sent and collected, its
        result verified with the agent's own download."""
        img, ref = self._image(name, size=2 << 20, qcow2=False, seed=seed)
        node = self._node(image_source=self.source.url(name + '.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        info = self._prepare(node)
        self._assert_served(node, info, ref)

    def test_forged_and_unsealed_answers_ahead_of_the_genuine_are_skipped(self):
        key = self._key_file('seal.key', OLD)
        self._worker(key)
        self._interface(key)
        img, ref = self._image('sealed', size=4 << 20, qcow2=False, seed=11)
        node = self._node(image_source=self.source.url('sealed.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        gate = self.source.gate('sealed.raw')
        self._send(node)
        node.refresh()
        request_id = node.driver_internal_info[deploy.PENDING]['request_id']
        queue = 'ironic-image-worker-deploy.reply.%s' % request_id
        # An answer that passes every check but the seal: this node's URL,
        # its request, the checksums of someone else's bytes.
        lure = json.dumps({
            'action': 'prepare', 'status': 'success',
            'request_id': request_id, 'node_uuid': node.uuid,
            'conductor_host': test_deploy.WORKER_HOST,
            'image_url': '%s/agent_images/%s' % (self.http_url, node.uuid),
            'image_checksum': 'f' * 32, 'image_os_hash_algo': 'sha256',
            'image_os_hash_value': 'f' * 64, 'image_size': 1,
            'image_disk_format': 'raw', 'converted': False,
            'cache': 'hit', 'duration_ms': 1}).encode()
        other = uuidutils.generate_uuid()

        def sealed(key, routing_key=queue, correlation_id=request_id):
            return {seal.HEADER: seal.seal([key], 'answer', routing_key,
                                           None, correlation_id, lure, 1, 0)}

        forged = [
            {},
            sealed(STRANGER),
            # The right key, sealed for another request's queue and id (a
            # genuine answer of another request carried over).
            sealed(OLD, routing_key=queue.replace(request_id, other)),
            sealed(OLD, correlation_id=other),
        ]
        urls, _ = worker_client.broker_urls(CONF)
        with kombu.Connection(urls[0]) as connection:
            producer = connection.Producer()
            for headers in forged:
                producer.publish(
                    lure, exchange='', routing_key=queue,
                    correlation_id=request_id, headers=headers,
                    content_type='application/json')
        # The worker answers only now, behind them.
        gate.set()
        info = self._collected(node)
        self._assert_served(node, info, ref)

    def test_a_key_rotation_loses_no_prepare(self):
        both = self._key_file('both.key', NEW, OLD)
        self._worker(both)
        # The worker has the new key and the old; the interface still the
        # old one.
        self._interface(self._key_file('old.key', OLD))
        self._deployed('rotation-old', 21)
        # The interface takes the new key.
        self._interface(self._key_file('new.key', NEW))
        self._deployed('rotation-new', 22)

    def test_a_rolling_upgrade_loses_no_prepare(self):
        key = self._key_file('seal.key', OLD)
        # The worker first, in send mode; the interface not sealing yet.
        worker = self._worker(key, mode='send')
        self._interface(None)
        self._deployed('upgrade-send', 31)
        # Both require.
        worker.stop()
        self._worker(key)
        self._interface(key)
        self._deployed('upgrade-require', 32)
