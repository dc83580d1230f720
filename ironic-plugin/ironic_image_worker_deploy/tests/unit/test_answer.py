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


"""The worker's answer to a prepare, as it lands in instance_info."""

import time
import types

from ironic.common import async_steps
from ironic.common import states
from ironic.conductor import task_manager
from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy.tests import base

URL = 'http://192.0.2.10:8080/agent_images/%s'

SOURCE_MD5 = '1' * 32
SERVED_MD5 = '2' * 32
SERVED_SHA256 = '3' * 64


def _answer(**fields):
    """A successful prepare completion, as the contract documents it."""
    done = {'action': 'prepare', 'status': 'success',
            'image_url': URL % 'node', 'image_checksum': SERVED_MD5,
            'image_os_hash_algo': 'sha256',
            'image_os_hash_value': SERVED_SHA256,
            'image_disk_format': 'raw', 'image_size': 4 << 20,
            'converted': True, 'cache': 'miss', 'duration_ms': 12}
    done.update(fields)
    return {k: v for k, v in done.items() if v is not None}


def _source(**fields):
    info = {'image_source': 'http://images.example/disk.qcow2',
            'image_checksum': SOURCE_MD5, 'image_disk_format': 'qcow2',
            'image_url': None}
    info.update(fields)
    return info


class ApplyAnswerTestCase(base.TestCase):
    """``apply_answer``: one answer, one field at a time."""

    def test_image_url_is_the_workers(self):
        info = deploy.apply_answer(_source(), _answer())
        self.assertEqual(URL % 'node', info['image_url'])

    def test_checksums_are_of_the_served_bytes(self):
        info = deploy.apply_answer(_source(), _answer())
        self.assertEqual(SERVED_MD5, info['image_checksum'])
        self.assertEqual('sha256', info['image_os_hash_algo'])
        self.assertEqual(SERVED_SHA256, info['image_os_hash_value'])

    def test_format_and_size_are_of_the_served_bytes(self):
        info = deploy.apply_answer(_source(), _answer())
        self.assertEqual('raw', info['image_disk_format'])
        self.assertEqual(4 << 20, info['image_size'])

    def test_no_checksum_in_the_answer_clears_the_sources(self):
        # A worker serving no MD5: the source's MD5 is of other bytes.
        info = deploy.apply_answer(_source(), _answer(image_checksum=None))
        self.assertIsNone(info['image_checksum'])
        self.assertEqual(SERVED_SHA256, info['image_os_hash_value'])

    def test_sha512_asked_is_kept(self):
        info = deploy.apply_answer(
            _source(image_os_hash_algo='sha512'),
            _answer(image_os_hash_algo='sha512',
                    image_os_hash_value='4' * 128))
        self.assertEqual('sha512', info['image_os_hash_algo'])
        self.assertEqual('4' * 128, info['image_os_hash_value'])

    def test_pass_through_keeps_what_the_answer_does_not_name(self):
        # image_download_source = http: the source URL comes back with the
        # checksum it was given, no format or size.
        info = deploy.apply_answer(
            _source(image_size=7),
            {'status': 'success', 'image_url': 'http://images.example/d',
             'image_checksum': SOURCE_MD5})
        self.assertEqual('http://images.example/d', info['image_url'])
        self.assertEqual(SOURCE_MD5, info['image_checksum'])
        self.assertEqual('qcow2', info['image_disk_format'])
        self.assertEqual(7, info['image_size'])
        self.assertNotIn('image_os_hash_value', info)

    def test_other_fields_are_left_alone(self):
        info = deploy.apply_answer(_source(image_type='whole-disk'),
                                   _answer())
        self.assertEqual('whole-disk', info['image_type'])
        self.assertEqual('http://images.example/disk.qcow2',
                         info['image_source'])
        self.assertNotIn('converted', info)
        self.assertNotIn('cache', info)


class CollectTestCase(base.TestCase):
    """``_collect`` with an answer at hand: Ironic's TaskManager and
    database, no worker asked."""

    def _node(self, instance_info, **pending):
        node = obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='fake-hardware', deploy_interface='direct-worker',
            provision_state=states.DEPLOYWAIT,
            target_provision_state=states.ACTIVE,
            instance_info=instance_info, driver_internal_info={})
        node.set_driver_internal_info(deploy.PENDING, dict(
            {'request_id': 'req-1', 'deadline': time.time() + 60},
            **pending))
        node.save()
        return node

    def _collect(self, node, done):
        with task_manager.acquire(self.context, node.uuid) as task:
            self.assertTrue(task.driver.deploy._collect(task, done))
        node.refresh()
        return node

    def test_answer_saved_and_pending_dropped(self):
        node = self._collect(self._node(_source()),
                             _answer(image_url=URL % 'n1'))
        self.assertEqual(URL % 'n1', node.instance_info['image_url'])
        self.assertEqual(SERVED_MD5, node.instance_info['image_checksum'])
        self.assertEqual(SERVED_SHA256,
                         node.instance_info['image_os_hash_value'])
        self.assertNotIn(deploy.PENDING, node.driver_internal_info)

    def test_answer_without_checksum_clears_it_in_the_node(self):
        node = self._collect(self._node(_source()),
                             _answer(image_checksum=None))
        self.assertIsNone(node.instance_info['image_checksum'])
        self.assertEqual('sha256', node.instance_info['image_os_hash_algo'])
        self.assertEqual(SERVED_SHA256,
                         node.instance_info['image_os_hash_value'])

    def test_oci_answer_records_the_manifest(self):
        manifest = 'oci://registry.example/os/disk@sha256:' + 'a' * 64
        node = self._collect(
            self._node(_source(image_source='oci://registry.example/os/d'),
                       oci=True),
            _answer(oci_image_manifest_url=manifest))
        self.assertEqual(manifest,
                         node.instance_info['oci_image_manifest_url'])
        self.assertEqual(manifest, node.driver_internal_info['image_source'])
        self.assertEqual('oci_artifact',
                         node.driver_internal_info['container_image_type'])


class PeriodicPredicateTestCase(base.TestCase):
    """Which nodes the periodic that collects answers looks at (and so
    locks): never one whose answer is collected while its ramdisk boots,
    or Ironic skips the agent's heartbeats while the lock is held."""

    def _looked_at(self, info):
        node = types.SimpleNamespace(driver_internal_info=info)
        return deploy._waiting_for_the_worker(node)

    def test_a_prepare_under_way(self):
        self.assertTrue(self._looked_at({deploy.PENDING: {'request_id': 'r'}}))

    def test_an_answer_collected_before_the_agent_is_ready(self):
        pending = {'request_id': 'r', 'done': _answer()}
        self.assertFalse(self._looked_at({deploy.PENDING: pending}))

    def test_an_answer_a_waiting_write_image_needs(self):
        pending = {'request_id': 'r', 'done': _answer()}
        self.assertTrue(self._looked_at({
            deploy.PENDING: pending,
            async_steps.DEPLOYMENT_POLLING: True}))

    def test_no_prepare(self):
        self.assertFalse(self._looked_at({}))
        self.assertFalse(self._looked_at(None))
