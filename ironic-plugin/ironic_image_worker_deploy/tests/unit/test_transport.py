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


"""Which transport reaches the worker: ``[image_worker]transport``."""

from ironic.conductor import task_manager
from ironic.conf import CONF
from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import client as worker_client
from ironic_image_worker_deploy import conf
from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy import json_rpc as worker_json_rpc
from ironic_image_worker_deploy.tests import base


class TransportTestCase(base.TestCase):

    def test_amqp_by_default(self):
        self.assertEqual('amqp', CONF.image_worker.transport)
        self.assertIsInstance(deploy.client_for(CONF),
                              worker_client.WorkerClient)

    def test_amqp_queue_is_the_conductors(self):
        self.config(host='conductor-7')
        self.config(queue_prefix='iiw', group='image_worker')
        client = deploy.client_for(CONF)
        self.assertEqual('iiw.conductor-7', client.queue)
        self.config(conductor_host='conductor-8', group='image_worker')
        self.assertEqual('iiw.conductor-8', client.queue)

    def test_json_rpc_when_asked(self):
        self.config(transport='json-rpc', group='image_worker')
        client = deploy.client_for(CONF, self.context)
        self.assertIsInstance(client, worker_json_rpc.JsonRpcWorkerClient)
        self.assertIs(self.context, client.context)

    def test_json_rpc_url_from_its_own_group(self):
        self.config(transport='json-rpc', group='image_worker')
        self.config(host_ip='::1', port=8443, use_ssl=True,
                    group=conf.JSON_RPC_GROUP)
        self.assertEqual('https://[::1]:8443',
                         deploy.client_for(CONF).url)
        self.config(host_ip='192.0.2.5', use_ssl=False,
                    group=conf.JSON_RPC_GROUP)
        self.assertEqual('http://192.0.2.5:8443',
                         deploy.client_for(CONF).url)

    def test_unknown_transport_is_refused(self):
        self.assertRaises(ValueError, self.config, transport='http',
                          group='image_worker')

    def test_the_interface_follows_the_option(self):
        node = obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='fake-hardware', deploy_interface='direct-worker')
        with task_manager.acquire(self.context, node.uuid) as task:
            iface = task.driver.deploy
            self.assertIsInstance(iface._client(task),
                                  worker_client.WorkerClient)
            self.config(transport='json-rpc', group='image_worker')
            client = iface._client(task)
            self.assertIsInstance(client,
                                  worker_json_rpc.JsonRpcWorkerClient)
            self.assertIs(task.context, client.context)


class ReasksTestCase(base.TestCase):
    """When a command still without its answer is sent again."""

    def test_after_the_first_pause_then_doubling_up_to_the_cap(self):
        reasks = worker_client.Reasks(30, 1000.0)
        self.assertFalse(reasks.due(1029.9))
        self.assertTrue(reasks.due(1030.0))
        self.assertFalse(reasks.due(1030.0))
        self.assertFalse(reasks.due(1089.9))
        self.assertTrue(reasks.due(1090.0))
        self.assertTrue(reasks.due(1210.0))
        self.assertTrue(reasks.due(1450.0))
        # At most every 5 minutes from then on.
        self.assertFalse(reasks.due(1749.9))
        self.assertTrue(reasks.due(1750.0))
        self.assertTrue(reasks.due(2050.0))

    def test_zero_never_asks_again(self):
        reasks = worker_client.Reasks(0, 1000.0)
        self.assertFalse(reasks.due(10 ** 9))
