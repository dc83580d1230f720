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

"""The direct-worker deploy interface against real parts.

Ironic 39's own database (sqlite, through its test fixtures), TaskManager and
deploy steps; the real RabbitMQ; the ironic-image-worker binary under test,
started by the cargo test (tests/it/ironic_plugin.rs) which passes its
parameters in IIW_* environment variables; images made with qemu-img; the
result downloaded with ironic-python-agent's own code.
"""

import json
import os
import shutil
import tempfile
import threading
import time
from unittest import mock

import fixtures as fx
import kombu

from ironic.common import states
from ironic.conductor import task_manager
from ironic.conductor import utils as conductor_utils
from ironic.conf import CONF
from ironic.drivers.modules import agent_client
from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import client as worker_client
from ironic_image_worker_deploy import conf
from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy import exception
from ironic_image_worker_deploy.tests import base
from ironic_image_worker_deploy.tests import parts

WORKER_HOST = parts.env('IIW_WORKER_HOST')

_WORLD = {}


def setUpModule():
    if not WORKER_HOST:
        return
    workdir = tempfile.mkdtemp(prefix='iiw-plugin-')
    os.makedirs(os.path.join(workdir, 'src'))
    _WORLD['dir'] = workdir
    _WORLD['source'] = parts.SourceServer(os.path.join(workdir, 'src'))
    _WORLD['glance'] = parts.GlanceServer(
        int(parts.env('IIW_GLANCE_PORT')))


def tearDownModule():
    for name in ('source', 'glance'):
        if name in _WORLD:
            _WORLD.pop(name).stop()
    if 'dir' in _WORLD:
        shutil.rmtree(_WORLD.pop('dir'), ignore_errors=True)


# Everything through which Ironic itself would download, convert or hash an
# instance image.
_CONDUCTOR_IMAGE_WORK = (
    'ironic.common.images.fetch',
    'ironic.common.images.image_to_raw',
    'ironic.common.images.converted_size',
    'ironic.drivers.modules.image_cache.ImageCache.fetch_image',
    'ironic.drivers.modules.deploy_utils.cache_instance_image',
    'ironic.drivers.modules.deploy_utils.fetch_images',
    'ironic.common.checksum_utils.compute_image_checksum',
    'ironic.common.image_service.HttpImageService.download',
    'ironic.common.glance_service.image_service.GlanceImageService.download',
    'ironic.common.image_service.OciImageService.identify_specific_image',
    'ironic.common.image_service.OciImageService.download',
    'ironic.common.oci_registry.OciClient.authenticate',
    'ironic.common.oci_registry.OciClient.get_artifact_index',
    'ironic.common.oci_registry.OciClient.get_manifest',
    'ironic.common.oci_registry.OciClient.download_blob_from_manifest',
    'ironic.common.oci_registry.RegistrySessionHelper.get',
)


class _DeployCase(base.TestCase):
    """Ironic drives the interface; the worker does the image work (the
    set-up and helpers of the cases below)."""

    def setUp(self):
        super().setUp()
        if not WORKER_HOST:
            self.skipTest('run through cargo test --test it ironic_plugin::')
        self.dir = _WORLD['dir']
        self.src = os.path.join(self.dir, 'src')
        self.source = _WORLD['source']
        self.glance = _WORLD['glance']
        self.http_root = parts.env('IIW_WORKER_HTTP_ROOT')
        self.images_path = parts.env('IIW_WORKER_IMAGES_PATH')
        self.http_url = 'http://127.0.0.1:%s' % parts.env(
            'IIW_WORKER_HTTP_PORT')
        self.config(host=WORKER_HOST)
        self.config(transport_url=parts.env(
            'IIW_TRANSPORT_URL', 'rabbit://guest:guest@127.0.0.1:5672/'))
        self.config(enabled_deploy_interfaces=[
            'fake', 'direct', 'direct-worker', 'autodetect', 'ramdisk'])
        self.config(autodetect_deploy_interfaces=['ramdisk',
                                                  'direct-worker'])
        # Fake management refuses the disk boot device of the last step.
        self.config(enabled_management_interfaces=['fake', 'noop'])
        self.config(http_url=self.http_url, http_root=self.http_root,
                    group='deploy')
        self.config(images_path=self.images_path,
                    instance_master_path=os.path.join(self.dir, 'ironic'),
                    group='pxe')
        self.config(image_download_source='local', group='agent')
        # The agent's kernel parameters name Ironic's API.
        self.config(auth_strategy='noauth')
        self.config(endpoint_override='http://127.0.0.1:6385',
                    group='service_catalog')
        self.config(auth_type='none',
                    endpoint_override='http://127.0.0.1:%d/image'
                    % self.glance.port, group='glance')
        self.config(prepare_timeout=60, command_timeout=10,
                    group='image_worker')
        self.image_work = []
        for target in _CONDUCTOR_IMAGE_WORK:
            patcher = self.useFixture(fx.MockPatch(
                target, side_effect=AssertionError('conductor image work')))
            self.image_work.append((target, patcher.mock))

    def tearDown(self):
        for target, m in getattr(self, 'image_work', []):
            self.assertFalse(m.called, '%s was called' % target)
        super().tearDown()

    # helpers

    def _image(self, name, size=24 << 20, qcow2=True, seed=1):
        """(served file, reference raw) made with qemu-img."""
        raw = os.path.join(self.src, name + '.raw')
        parts.patchy_raw(raw, size, seed)
        if not qcow2:
            return raw, raw
        img = os.path.join(self.src, name + '.qcow2')
        parts.qcow2_from(raw, img)
        ref = os.path.join(self.dir, name + '.ref')
        parts.reference_raw(img, ref)
        return img, ref

    def _node(self, **instance_info):
        return obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='fake-hardware', deploy_interface='direct-worker',
            boot_interface='fake', power_interface='fake',
            management_interface='noop', network_interface='noop',
            provision_state=states.DEPLOYING,
            target_provision_state=states.ACTIVE,
            instance_info=instance_info, driver_internal_info={})

    def _send(self, node):
        """What the conductor does as a deploy starts: the prepare is sent
        to the worker, not waited for."""
        with task_manager.acquire(self.context, node.uuid) as task:
            conductor_utils.update_image_type(task.context, task.node)
            task.driver.deploy.validate(task)
            task.driver.deploy.prepare(task)
            self.assertIsNone(task.node.instance_info['image_url'])
            self.assertIn(deploy.PENDING, task.node.driver_internal_info)

    def _collected(self, node, within=120):
        """The instance_info once the worker's answer is collected (as the
        write_image step collects it, asked again until it is there)."""
        deadline = time.monotonic() + within
        while True:
            with task_manager.acquire(self.context, node.uuid) as task:
                if task.driver.deploy._collect(task):
                    self.assertNotIn(deploy.PENDING,
                                     task.node.driver_internal_info)
                    return task.node.instance_info
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.05)

    def _prepare(self, node):
        """The prepare sent, then its answer collected."""
        self._send(node)
        return self._collected(node)

    def _agent_image_info(self, node):
        """The image_info Ironic's write_image step hands the agent."""
        with mock.patch.object(agent_client.AgentClient,
                               'execute_deploy_step', autospec=True,
                               return_value={'command_status': 'RUNNING'}
                               ) as m, \
                task_manager.acquire(self.context, node.uuid) as task:
            self.assertEqual(states.DEPLOYWAIT,
                             task.driver.deploy.write_image(task))
        return m.call_args[0][1]['args']['image_info']

    def _record_commands(self, before=None):
        """(action, answer) of every deployed / cleanup the interface sends
        (through its real code, after calling ``before``)."""
        sent = []
        real_tell = deploy.DirectWorkerDeploy._tell_worker

        def tell(iface, task, action, **kwargs):
            if before is not None:
                before()
            done = real_tell(iface, task, action, **kwargs)
            sent.append((action, done))
            return done

        self.useFixture(fx.MockPatchObject(
            deploy.DirectWorkerDeploy, '_tell_worker', autospec=True,
            side_effect=tell))
        return sent

    def _when(self, condition, action):
        """Runs ``action`` on a thread once ``condition()`` holds (checked
        every 50 ms for up to a minute); join the returned thread."""
        def run():
            deadline = time.monotonic() + 60
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.05)
            action()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def _node_files(self, node):
        return [p for p in (
            os.path.join(self.images_path, node.uuid, 'disk'),
            os.path.join(self.http_root, 'agent_images', node.uuid))
            if os.path.lexists(p)]

    # Whether the worker under test publishes the MD5 of what it serves
    # ([agent]served_md5).
    served_md5 = True

    def _assert_served(self, node, info, reference, algo='sha256'):
        self.assertEqual('%s/agent_images/%s' % (self.http_url, node.uuid),
                         info['image_url'])
        if self.served_md5:
            self.assertEqual(parts.file_hash(reference, 'md5'),
                             info['image_checksum'])
        else:
            # As Ironic leaves instance_info after its own conversion.
            self.assertIsNone(info['image_checksum'])
        if algo is None:
            algo = info['image_os_hash_algo']
            self.assertIn(algo, ('sha256', 'sha512'))
        self.assertEqual(algo, info['image_os_hash_algo'])
        self.assertEqual(parts.file_hash(reference, algo),
                         info['image_os_hash_value'])
        self.assertEqual(os.path.getsize(reference), info['image_size'])
        self.assertEqual(2, len(self._node_files(node)))
        image_info = self._agent_image_info(node)
        if not self.served_md5:
            self.assertIsNone(image_info.get('checksum'))
        got = parts.ipa_download(image_info, self.dir)
        self.assertEqual(parts.file_hash(reference, 'md5'),
                         parts.file_hash(got, 'md5'))
        os.unlink(got)


class DirectWorkerTestCase(_DeployCase):
    """Through RabbitMQ (the default transport)."""

    def test_http_qcow2_converted_and_verified_by_the_agent(self):
        img, ref = self._image('conv')
        node = self._node(image_source=self.source.url('conv.qcow2'),
                          image_os_hash_algo='sha256',
                          image_os_hash_value=parts.file_hash(
                              img, 'sha256'),
                          image_disk_format='qcow2')
        info = self._prepare(node)
        self.assertEqual('raw', info['image_disk_format'])
        self.assertEqual('whole-disk', info['image_type'])
        self._assert_served(node, info, ref)
        self.assertEqual(1, self.source.count('GET', '/conv.qcow2'))

    def test_raw_served_as_it_is(self):
        # A multi-host transport URL whose first host is down: the next one
        # is used.
        self.config(transport_url='rabbit://guest:guest@127.0.0.1:1,'
                    + parts.env('IIW_TRANSPORT_URL').split('//', 1)[1])
        # The answer comes through a classic reply queue as well.
        self.config(reply_queue_type='classic', group='image_worker')
        img, ref = self._image('plain', size=6 << 20, qcow2=False, seed=2)
        node = self._node(image_source=self.source.url('plain.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        info = self._prepare(node)
        self.assertEqual('raw', info['image_disk_format'])
        self._assert_served(node, info, ref)

    def test_glance_image(self):
        img, ref = self._image('glance', size=16 << 20, seed=3)
        image_id = self.glance.add(img, 'qcow2', hw_firmware_type='uefi')
        node = self._node(image_source=image_id)
        info = self._prepare(node)
        self.assertEqual('raw', info['image_disk_format'])
        self.assertEqual('bare', info['image_container_format'])
        self.assertEqual(['tested'], info['image_tags'])
        self.assertEqual('uefi',
                         info['image_properties'].get('hw_firmware_type'))
        # The hash is of the converted bytes, with the algorithm Ironic
        # passes on from Glance's metadata (sha256 when none).
        self._assert_served(node, info, ref, algo=None)
        self.assertEqual(1, self.glance.data_gets(image_id))

    def test_checksum_mismatch_is_an_ironic_error_with_the_code(self):
        img, _ = self._image('liar', size=4 << 20, qcow2=False, seed=4)
        node = self._node(image_source=self.source.url('liar.raw'),
                          image_os_hash_algo='sha256',
                          image_os_hash_value='0' * 64)
        sent = self._record_commands()
        e = self.assertRaises(exception.ImageWorkerPrepareFailed,
                              self._prepare, node)
        self.assertEqual('checksum_mismatch', e.error_code)
        self.assertIn('checksum_mismatch', str(e))
        self.assertEqual([], self._node_files(node))
        # Ironic does not call clean_up for a failure in prepare: the
        # interface withdraws the node itself.
        self.assertEqual(['cleanup'], [a for a, _ in sent])
        self.assertEqual('success', sent[0][1]['status'])

    def test_prepare_finished_after_the_timeout_is_withdrawn(self):
        img, _ = self._image('late', size=4 << 20, qcow2=False, seed=7)
        node = self._node(image_source=self.source.url('late.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        self.config(prepare_timeout=2, group='image_worker')
        gate = self.source.gate('late.raw')
        # The worker finishes its download only once the interface has
        # given up, then gets the cleanup.
        sent = self._record_commands(before=gate.set)
        e = self.assertRaises(exception.ImageWorkerTimeout,
                              self._prepare, node)
        self.assertEqual('timeout', e.error_code)
        self.assertTrue(e.sent)
        self.assertEqual(1, self.source.count('GET', '/late.raw'))
        # The worker published the node, then withdrew it.
        self.assertEqual(['cleanup'], [a for a, _ in sent])
        self.assertEqual('success', sent[0][1]['status'])
        self.assertEqual([], self._node_files(node))

    def test_forged_answers_on_the_reply_queue_are_skipped(self):
        # Anyone on the broker may publish to a prepare's reply queue (it is
        # named after the request): what is not the worker's answer to this
        # very request is skipped, and the agent gets the worker's own.
        img, ref = self._image('forged', size=4 << 20, qcow2=False, seed=9)
        node = self._node(image_source=self.source.url('forged.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        gate = self.source.gate('forged.raw')
        self._send(node)
        node.refresh()
        request_id = node.driver_internal_info[deploy.PENDING]['request_id']
        other = uuidutils.generate_uuid()
        lure = {'action': 'prepare', 'status': 'success',
                'request_id': request_id, 'node_uuid': node.uuid,
                'conductor_host': WORKER_HOST,
                'image_url': 'http://192.0.2.66/evil.raw',
                'image_checksum': 'f' * 32, 'image_os_hash_algo': 'sha256',
                'image_os_hash_value': 'f' * 64, 'image_size': 1,
                'image_disk_format': 'raw', 'converted': False,
                'cache': 'hit', 'duration_ms': 1}
        of_node = '%s/agent_images/' % self.http_url
        forged = [
            lure,
            dict(lure, node_uuid=other, image_url=of_node + other),
            dict(lure, request_id=other, image_url=of_node + node.uuid),
            dict(lure, action='warm', image_url=of_node + node.uuid),
        ]
        urls, _ = worker_client.broker_urls(CONF)
        with kombu.Connection(urls[0]) as connection:
            producer = connection.Producer()
            for body in forged:
                producer.publish(
                    json.dumps(body), exchange='',
                    routing_key='ironic-image-worker-deploy.reply.%s'
                    % request_id, correlation_id=request_id,
                    content_type='application/json')
        # The worker answers only now, behind them.
        gate.set()
        info = self._collected(node)
        self._assert_served(node, info, ref)

    def test_an_answer_lost_on_the_broker_is_asked_for_again(self):
        # The worker's answer is taken off the reply queue before the
        # interface sees it (as with a broker node lost with it): the
        # interface sends the prepare again once it is overdue, and the
        # worker's answer to that (a cache hit) is collected, long before
        # the prepare's timeout.
        img, ref = self._image('lost', size=4 << 20, qcow2=False, seed=11)
        node = self._node(image_source=self.source.url('lost.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        self.config(reask_after=1, group='image_worker')
        self._send(node)
        node.refresh()
        request_id = node.driver_internal_info[deploy.PENDING]['request_id']
        queue = 'ironic-image-worker-deploy.reply.%s' % request_id
        urls, _ = worker_client.broker_urls(CONF)
        with kombu.Connection(urls[0]) as connection:
            channel = connection.channel()
            deadline = time.monotonic() + 60
            while channel.basic_get(queue=queue, no_ack=True) is None:
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.05)
        info = self._collected(node, within=20)
        self._assert_served(node, info, ref)
        self.assertEqual(1, self.source.count('GET', '/lost.raw'))

    def test_two_nodes_one_image_one_download(self):
        img, ref = self._image('shared', size=8 << 20, seed=5)
        sha = parts.file_hash(img, 'sha256')
        nodes = [self._node(image_source=self.source.url('shared.qcow2'),
                            image_os_hash_algo='sha256',
                            image_os_hash_value=sha)
                 for _ in range(2)]
        infos = [self._prepare(n) for n in nodes]
        self.assertEqual(infos[0]['image_os_hash_value'],
                         infos[1]['image_os_hash_value'])
        self.assertNotEqual(infos[0]['image_url'], infos[1]['image_url'])
        self.assertEqual(1, self.source.count('GET', '/shared.qcow2'))
        for n in nodes:
            self.assertEqual(2, len(self._node_files(n)))

    def test_deployed_and_teardown_remove_the_node_files(self):
        img, _ = self._image('life', size=4 << 20, qcow2=False, seed=6)
        source = self.source.url('life.raw')
        md5 = parts.file_hash(img, 'md5')
        real_tell = deploy.DirectWorkerDeploy._tell_worker
        sent = self._record_commands()
        # Deployed: the step after the image is written.
        node = self._node(image_source=source, image_checksum=md5)
        self._prepare(node)
        with mock.patch.object(agent_client.AgentClient,
                               'get_partition_uuids', autospec=True,
                               return_value={'command_result': {}}), \
                mock.patch.object(agent_client.AgentClient,
                                  'install_bootloader', autospec=True,
                                  return_value={
                                      'command_status': 'SUCCEEDED'}), \
                task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.prepare_instance_boot(task)
        self.assertEqual('deployed', sent[-1][0])
        self.assertEqual('success', sent[-1][1]['status'])
        self.assertEqual([], self._node_files(node))
        # Teardown of a node that still has its files (deploy failed).
        node = self._node(image_source=source, image_checksum=md5)
        self._prepare(node)
        self.assertEqual(2, len(self._node_files(node)))
        with task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.clean_up(task)
            task.driver.deploy.tear_down(task)
        self.assertEqual('cleanup', sent[-1][0])
        self.assertEqual('success', sent[-1][1]['status'])
        self.assertEqual([], self._node_files(node))
        # Ironic removes the same files itself; the worker's cleanup alone
        # removes them too.
        node = self._node(image_source=source, image_checksum=md5)
        self._prepare(node)
        with task_manager.acquire(self.context, node.uuid) as task:
            done = real_tell(task.driver.deploy, task, 'cleanup')
        self.assertEqual('success', done['status'])
        self.assertEqual([], self._node_files(node))

    def test_no_worker_for_the_host_fails_at_once(self):
        self.config(conductor_host='nobody-%s' % uuidutils.generate_uuid(),
                    group='image_worker')
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        started = time.monotonic()
        e = self.assertRaises(exception.ImageWorkerNotListening,
                              self._prepare, node)
        self.assertEqual('no_worker', e.error_code)
        self.assertLess(time.monotonic() - started, 30)

    def _spare(self):
        spare = parts.SpareWorker(
            parts.env('IIW_WORKER_BIN'), parts.env('IIW_SPARE_CONFIG'),
            int(parts.env('IIW_SPARE_METRICS_PORT')))
        self.addCleanup(spare.stop)
        # Without the grace, a prepare would wait for its whole timeout
        # (which stays below the test's own deadline).
        self.config(conductor_host=parts.env('IIW_SPARE_HOST'),
                    worker_restart_grace=1, prepare_timeout=30,
                    group='image_worker')
        return spare

    def test_stopped_worker_fails_after_the_grace_not_the_timeout(self):
        spare = self._spare()
        spare.start()
        spare.stop()
        # Its queue stays (durable) with no consumer. The prepare timeout
        # is long: a deadline error would mean the wait was not cut short.
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        sent = self._record_commands()
        e = self.assertRaises(exception.ImageWorkerNotConsuming,
                              self._prepare, node)
        self.assertEqual('no_worker', e.error_code)
        self.assertIn(parts.env('IIW_SPARE_HOST'), str(e))
        # Never sent, so nothing to withdraw.
        self.assertFalse(e.sent)
        self.assertEqual([], sent)

    def test_no_consumer_never_outlives_the_prepare_timeout(self):
        spare = self._spare()
        # The restart grace (30 s) is longer than the prepare's timeout.
        self.config(worker_restart_grace=30, prepare_timeout=3,
                    group='image_worker')
        spare.start()
        spare.stop()
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        started = time.monotonic()
        e = self.assertRaises(exception.ImageWorkerNotConsuming,
                              self._prepare, node)
        # The timeout and room for a loaded machine, well short of the
        # timeout and the grace together (33 s).
        self.assertLess(time.monotonic() - started, 3 + 10)
        self.assertFalse(e.sent)

    def test_worker_dying_during_the_prepare_fails_at_the_timeout(self):
        img, _ = self._image('dying', size=4 << 20, qcow2=False, seed=9)
        node = self._node(image_source=self.source.url('dying.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        spare = self._spare()
        self.config(prepare_timeout=5, group='image_worker')
        spare.start()
        gate = self.source.gate('dying.raw')
        sent = self._record_commands()
        thread = self._when(
            lambda: self.source.count('GET', '/dying.raw') > 0, spare.kill)
        started = time.monotonic()
        e = self.assertRaises(exception.ImageWorkerTimeout,
                              self._prepare, node)
        thread.join()
        # Within prepare_timeout (and room for a poll on a loaded
        # machine), never the restart grace (30 s) beyond it.
        self.assertLess(time.monotonic() - started, 5 + 10)
        self.assertTrue(e.sent)
        # The prepare is back in the queue: a cleanup follows it, not
        # waited for (nobody consumes).
        self.assertEqual([('cleanup', None)], sent)
        # The worker back does both (and leaves its queue empty).
        gate.set()
        spare.start()

    def test_teardown_survives_an_unreachable_broker(self):
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        self.config(transport_url='rabbit://guest:guest@127.0.0.1:1/',
                    group='image_worker')
        with task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.clean_up(task)
            e = self.assertRaises(
                exception.ImageWorkerBrokerUnreachable,
                task.driver.deploy._build_instance_info, task)
        self.assertEqual('broker_unreachable', e.error_code)

    def test_autodetect_falls_back_to_it(self):
        # What Metal3 ships: autodetect, with direct-worker last in
        # autodetect_deploy_interfaces (Ironic's own autodetect code).
        self.config(default_deploy_interface='autodetect',
                    autodetect_deploy_interfaces=['ramdisk',
                                                  'direct-worker'])
        img, ref = self._image('auto', size=4 << 20, qcow2=False, seed=10)
        node = self._node(image_source=self.source.url('auto.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        node.deploy_interface = 'autodetect'
        node.save()
        with task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.switch_interface(task)
            self.assertIsInstance(task.driver.deploy,
                                  deploy.DirectWorkerDeploy)
            self.assertEqual('direct-worker', task.node.deploy_interface)
        info = self._prepare(node)
        self._assert_served(node, info, ref)

    def test_oci_image_is_prepared_by_the_worker(self):
        # A registry of the test's own (htpasswd), the image pushed to it
        # under an index naming arm64; Ironic's OCI code (resolving,
        # downloading, any request to a registry) is conductor image work
        # and must not run.
        img, ref = self._image('oci', size=8 << 20, seed=11)
        password = 'pull-%s' % uuidutils.generate_uuid()
        secret = 'robot:%s' % password
        registry = parts.Registry(
            os.path.join(self.dir, 'registry-%s' % uuidutils.generate_uuid()),
            'robot', password)
        self.addCleanup(registry.stop)
        manifest = registry.push_disk('os/disk', 'v1', img, 'qcow2',
                                      arch='arm64')
        logs = self.useFixture(fx.FakeLogger(level='DEBUG'))
        node = self._node(image_source=registry.oci('os/disk:v1'),
                          image_disk_format='qcow2',
                          # Stale, from a deploy Ironic prepared itself.
                          image_request_authorization_secret='stale')
        node.driver_info = {'image_pull_secret': secret}
        # Ironic's name for the index's arm64.
        node.properties = {'cpu_arch': 'aarch64'}
        node.save()
        info = self._prepare(node)
        self.assertEqual(registry.oci('os/disk@%s' % manifest),
                         info['oci_image_manifest_url'])
        self.assertEqual(registry.oci('os/disk:v1'), info['image_source'])
        self.assertEqual('raw', info['image_disk_format'])
        self.assertEqual('whole-disk', info['image_type'])
        self.assertNotIn('image_request_authorization_secret', info)
        node.refresh()
        self.assertEqual('oci_artifact',
                         node.driver_internal_info['container_image_type'])
        self.assertEqual(info['oci_image_manifest_url'],
                         node.driver_internal_info['image_source'])
        # Served with the checksums of the converted bytes; the agent gets
        # the worker's URL only, no registry token.
        self._assert_served(node, info, ref)
        image_info = self._agent_image_info(node)
        self.assertEqual([info['image_url']], image_info['urls'])
        self.assertNotIn('image_request_authorization', image_info)
        # The secret from instance_info wins over driver_info's: a wrong
        # one fails the deploy with the worker's code.
        node.instance_info = dict(node.instance_info,
                                  image_pull_secret='robot:wrong')
        node.save()
        e = self.assertRaises(exception.ImageWorkerPrepareFailed,
                              self._prepare, node)
        self.assertEqual('source_not_allowed', e.error_code)
        self.assertNotIn(password, logs.output)
        self.assertNotIn('robot:wrong', logs.output)


class DirectWorkerJsonRpcTestCase(_DeployCase):
    """Through Ironic's own JSON-RPC client ([image_worker]transport =
    json-rpc) to a worker with no broker at all, over TLS with a CA and
    HTTP Basic against its htpasswd file. The conductor's broker is
    pointed at a closed port: nothing may need it. That worker publishes
    no MD5 ([agent]served_md5 = false)."""

    served_md5 = False

    def setUp(self):
        super().setUp()
        if not parts.env('IIW_RPC_PORT'):
            self.skipTest('run through cargo test --test it ironic_plugin::')
        self.http_root = parts.env('IIW_RPC_HTTP_ROOT')
        self.images_path = parts.env('IIW_RPC_IMAGES_PATH')
        self.http_url = 'http://127.0.0.1:%s' % parts.env('IIW_RPC_HTTP_PORT')
        self.config(http_url=self.http_url, http_root=self.http_root,
                    group='deploy')
        self.config(images_path=self.images_path, group='pxe')
        self.config(transport_url='rabbit://guest:guest@127.0.0.1:1/')
        self.config(transport='json-rpc', group='image_worker')
        self._rpc(parts.env('IIW_RPC_PASSWORD'))

    def _rpc(self, password, port=None):
        """[image_worker_json_rpc] as an operator writes it."""
        from keystoneauth1 import loading
        from ironic.common.json_rpc import client as json_rpc_client
        group = conf.JSON_RPC_GROUP
        # What keystoneauth registers when it loads the plugin named by
        # auth_type from ironic.conf.
        CONF.register_opts(loading.get_auth_plugin_conf_options('http_basic'),
                           group=group)
        self.config(host_ip='127.0.0.1',
                    port=int(port or parts.env('IIW_RPC_PORT')),
                    auth_strategy='http_basic', auth_type='http_basic',
                    username=parts.env('IIW_RPC_USER'), password=password,
                    use_ssl=True, cafile=parts.env('IIW_RPC_CA'),
                    group=group)
        json_rpc_client._SESSIONS.pop(group, None)
        self.addCleanup(json_rpc_client._SESSIONS.pop, group, None)

    def test_deploy_overlaps_the_image_work_with_the_boot(self):
        img, ref = self._image('rpc', size=16 << 20, seed=21)
        node = self._node(image_source=self.source.url('rpc.qcow2'),
                          image_os_hash_algo='sha256',
                          image_os_hash_value=parts.file_hash(img, 'sha256'))
        gate = self.source.gate('rpc.qcow2')
        started = time.monotonic()
        self._send(node)
        # Sent, not waited for: the worker is still downloading.
        self.assertLess(time.monotonic() - started, 10)
        node.refresh()
        node.provision_state = states.DEPLOYWAIT
        node.save()
        # The agent is ready before the image: the step waits (polling).
        with mock.patch.object(agent_client.AgentClient,
                               'execute_deploy_step', autospec=True) as m, \
                task_manager.acquire(self.context, node.uuid) as task:
            self.assertEqual(states.DEPLOYWAIT,
                             task.driver.deploy.write_image(task))
            self.assertFalse(m.called)
            self.assertTrue(task.node.driver_internal_info[
                'deployment_polling'])
        gate.set()
        resumed = []
        with mock.patch.object(
                deploy.manager_utils, 'notify_conductor_resume_deploy',
                autospec=True, side_effect=lambda t: resumed.append(
                    t.node.uuid)):
            deadline = time.monotonic() + 60
            while not resumed and time.monotonic() < deadline:
                with task_manager.acquire(self.context, node.uuid,
                                          shared=True) as task:
                    task.driver.deploy.check_prepare(task)
                time.sleep(0.1)
        self.assertEqual([node.uuid], resumed)
        node.refresh()
        self.assertNotIn('deployment_polling', node.driver_internal_info)
        # The step runs again: the agent gets the worker's URL.
        info = self._collected(node)
        self._assert_served(node, info, ref)
        self.assertEqual(1, self.source.count('GET', '/rpc.qcow2'))

    def test_two_nodes_one_image_one_download(self):
        img, ref = self._image('rpc2', size=8 << 20, seed=22)
        sha = parts.file_hash(img, 'sha256')
        nodes = [self._node(image_source=self.source.url('rpc2.qcow2'),
                            image_os_hash_algo='sha256',
                            image_os_hash_value=sha) for _ in range(2)]
        for n in nodes:
            self._send(n)
        infos = [self._collected(n) for n in nodes]
        self.assertNotEqual(infos[0]['image_url'], infos[1]['image_url'])
        self.assertEqual(1, self.source.count('GET', '/rpc2.qcow2'))
        self._assert_served(nodes[1], infos[1], ref)

    def test_checksum_mismatch_fails_the_deploy_with_the_code(self):
        self._image('rpcliar', size=4 << 20, qcow2=False, seed=23)
        node = self._node(image_source=self.source.url('rpcliar.raw'),
                          image_os_hash_algo='sha256',
                          image_os_hash_value='0' * 64)
        sent = self._record_commands()
        self._send(node)
        # While the ramdisk still boots: the failure fails the deploy.
        node.refresh()
        node.provision_state = states.DEPLOYWAIT
        node.save()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with task_manager.acquire(self.context, node.uuid,
                                      shared=True) as task:
                task.driver.deploy.check_prepare(task)
            node.refresh()
            if node.provision_state != states.DEPLOYWAIT:
                break
            time.sleep(0.1)
        self.assertEqual(states.DEPLOYFAIL, node.provision_state)
        self.assertIn('checksum_mismatch', node.last_error)
        self.assertEqual([], self._node_files(node))
        self.assertEqual(['cleanup'], [a for a, _ in sent])
        self.assertEqual('success', sent[0][1]['status'])

    def test_deployed_and_teardown_remove_the_node_files(self):
        img, _ = self._image('rpclife', size=4 << 20, qcow2=False, seed=24)
        node = self._node(image_source=self.source.url('rpclife.raw'),
                          image_checksum=parts.file_hash(img, 'md5'))
        sent = self._record_commands()
        self._prepare(node)
        self.assertEqual(2, len(self._node_files(node)))
        with task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.clean_up(task)
        self.assertEqual('cleanup', sent[-1][0])
        self.assertEqual('success', sent[-1][1]['status'])
        self.assertEqual([], self._node_files(node))

    def test_worker_down_fails_at_once(self):
        import socket
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            closed = s.getsockname()[1]
        self._rpc(parts.env('IIW_RPC_PASSWORD'), port=closed)
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        started = time.monotonic()
        e = self.assertRaises(exception.ImageWorkerUnreachable,
                              self._send, node)
        self.assertLess(time.monotonic() - started,
                        CONF.image_worker.prepare_timeout)
        self.assertEqual('no_worker', e.error_code)
        self.assertIn('[image_worker_json_rpc]host_ip', str(e))
        self.assertFalse(e.sent)

    def test_validate_refuses_a_worker_url_the_agent_cannot_read(self):
        from ironic.common import exception as ironic_exception
        self.config(image_server_auth=True, group='image_worker')
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)

        def validate():
            with task_manager.acquire(self.context, node.uuid) as task:
                conductor_utils.update_image_type(task.context, task.node)
                task.driver.deploy.validate(task)

        e = self.assertRaises(ironic_exception.InvalidParameterValue,
                              validate)
        self.assertIn('[deploy]image_server_auth_strategy', str(e))
        self.config(image_server_auth_strategy='http_basic',
                    image_server_user='agent', image_server_password='pw',
                    image_server_auth_hosts=['images.example.com'],
                    group='deploy')
        e = self.assertRaises(ironic_exception.InvalidParameterValue,
                              validate)
        self.assertIn('[deploy]image_server_auth_hosts', str(e))
        self.config(image_server_auth_hosts=['127.0.0.1'], group='deploy')
        validate()

    def test_a_prepare_the_worker_lost_fails_at_once(self):
        # As after a restart of the worker: it has no record of the
        # request the node waits for.
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        node.set_driver_internal_info(deploy.PENDING, {
            'request_id': uuidutils.generate_uuid(),
            'deadline': time.time() + 600})
        node.save()
        started = time.monotonic()
        with task_manager.acquire(self.context, node.uuid) as task:
            e = self.assertRaises(exception.ImageWorkerPrepareFailed,
                                  task.driver.deploy._collect, task)
        self.assertEqual('no_worker', e.error_code)
        self.assertLess(time.monotonic() - started, 30)

    def test_wrong_password_is_refused_naming_the_options(self):
        self._rpc('not-the-password')
        node = self._node(image_source=self.source.url('absent.raw'),
                          image_checksum='0' * 32)
        e = self.assertRaises(exception.ImageWorkerUnauthorized,
                              self._send, node)
        self.assertEqual('unauthorized', e.error_code)
        self.assertIn('[image_worker_json_rpc]', str(e))
        self.assertIn('http_basic_auth_user_file', str(e))
