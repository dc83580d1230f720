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


"""Ironic's private hook the interface overrides, pinned.

``DirectWorkerDeploy`` overrides ``_update_instance_info``, the method
Ironic's ``CustomAgentDeploy.prepare`` calls to fill ``instance_info`` (and
``AgentDeploy`` overrides to cache and hash the image in the conductor).
Ironic 39 offers no public hook there. These tests fail when a release
renames it, changes its signature or stops calling it from ``prepare``:
the interface would then silently fall back to Ironic's own image work.
"""

import inspect

import fixtures as fx
from ironic.common import states
from ironic.conductor import task_manager
from ironic.drivers.modules import agent
from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy.tests import base


class _Recorder:
    """Takes the commands the interface sends (no worker in unit tests)."""

    def __init__(self):
        self.sent = []

    def send(self, action, node_uuid, **kwargs):
        self.sent.append((action, node_uuid, kwargs))
        return 'req-%d' % len(self.sent)


class IronicHookTestCase(base.TestCase):

    def test_signature_is_self_and_task(self):
        for cls in (agent.CustomAgentDeploy, agent.AgentDeploy,
                    deploy.DirectWorkerDeploy):
            self.assertEqual(
                ['self', 'task'],
                list(inspect.signature(cls._update_instance_info).parameters),
                cls.__name__)

    def test_direct_fills_instance_info_there(self):
        # The method overridden is the one where direct does the image
        # work the worker takes over.
        self.assertIn('_update_instance_info', vars(agent.AgentDeploy))
        self.assertIn('_update_instance_info', vars(deploy.DirectWorkerDeploy))

    def test_ironics_prepare_reaches_it(self):
        # The conductor's own image work must not run at all.
        self.useFixture(fx.MockPatch(
            'ironic.drivers.modules.deploy_utils.'
            'build_instance_info_for_deploy',
            side_effect=AssertionError('conductor image work')))
        recorder = _Recorder()
        self.useFixture(fx.MockPatchObject(
            deploy.DirectWorkerDeploy, '_client',
            side_effect=lambda task=None: recorder))
        # The agent's boot needs Ironic's API URL; not what is tested.
        self.config(manage_agent_boot=False, group='agent')
        source = 'http://images.example/disk.qcow2'
        node = obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='fake-hardware', deploy_interface='direct-worker',
            boot_interface='fake', power_interface='fake',
            management_interface='fake', network_interface='noop',
            provision_state=states.DEPLOYING,
            target_provision_state=states.ACTIVE,
            instance_info={'image_source': source,
                           'image_os_hash_algo': 'sha256',
                           'image_os_hash_value': 'a' * 64},
            driver_internal_info={'is_whole_disk_image': True})
        with task_manager.acquire(self.context, node.uuid) as task:
            task.driver.deploy.prepare(task)
        [(action, node_uuid, kwargs)] = recorder.sent
        self.assertEqual(('prepare', node.uuid), (action, node_uuid))
        self.assertEqual(source, kwargs['instance_info']['image_source'])
        node.refresh()
        self.assertEqual('req-1',
                         node.driver_internal_info[deploy.PENDING][
                             'request_id'])
        self.assertIsNone(node.instance_info['image_url'])
        self.assertEqual('whole-disk', node.instance_info['image_type'])
