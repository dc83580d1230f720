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


"""The ``[image_worker]`` and ``[image_worker_json_rpc]`` options."""

import importlib.metadata
from unittest import mock

from ironic.conf import CONF
from oslo_config import cfg

from ironic_image_worker_deploy import client as worker_client
from ironic_image_worker_deploy import conf
from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy.tests import base

WORKER_OPTIONS = {'exchange', 'queue_prefix', 'conductor_host',
                  'transport_url', 'prepare_timeout', 'command_timeout',
                  'worker_restart_grace', 'reply_queue_type',
                  'connect_timeout', 'transport', 'poll_interval',
                  'image_server_auth', 'extend_hardware_types',
                  'seal_secret_file', 'seal', 'reask_after'}


class OptionsTestCase(base.TestCase):

    def test_registered_on_ironics_configuration(self):
        self.assertTrue(WORKER_OPTIONS <= set(CONF.image_worker))
        self.assertEqual(1800, CONF.image_worker.prepare_timeout)
        self.assertEqual([], CONF.image_worker.extend_hardware_types)

    def test_listed_for_the_config_generator(self):
        [(group, opts), (rpc_group, rpc_opts)] = conf.list_opts()
        self.assertEqual('image_worker', group)
        self.assertEqual(WORKER_OPTIONS, {o.name for o in opts})
        # Ironic's own JSON-RPC client options, as for [json_rpc].
        self.assertEqual('image_worker_json_rpc', rpc_group)
        self.assertTrue({'host_ip', 'port', 'auth_strategy', 'use_ssl',
                         'cafile', 'username', 'password'}
                        <= {o.name for o in rpc_opts})
        # The defaults in force, as the sample configuration prints them.
        defaults = {o.name: o.default for o in rpc_opts}
        self.assertEqual(8099, defaults['port'])
        self.assertEqual('127.0.0.1', defaults['host_ip'])

    def test_config_generator_entry_point(self):
        [entry_point] = importlib.metadata.entry_points(
            group='oslo.config.opts', name='ironic_image_worker_deploy')
        self.assertIs(conf.list_opts, entry_point.load())

    def test_json_rpc_port_is_not_ironics(self):
        # Both listen on one host. (A fresh configuration: the test
        # fixture's reset drops set defaults.)
        fresh = cfg.ConfigOpts()
        conf.register_opts(fresh)
        fresh([])
        self.assertEqual(conf.JSON_RPC_PORT, fresh.image_worker_json_rpc.port)
        self.assertNotEqual(CONF.json_rpc.port,
                            fresh.image_worker_json_rpc.port)
        self.assertEqual('127.0.0.1', fresh.image_worker_json_rpc.host_ip)

    def test_registered_once_per_process(self):
        # The first look at the broker's TLS settings registers
        # [oslo_messaging_rabbit] if oslo.messaging has not yet.
        worker_client.ssl_params()
        with mock.patch.object(CONF, 'register_opts', autospec=True) as m, \
                mock.patch.object(CONF, 'register_opt', autospec=True) as o:
            deploy.DirectWorkerDeploy()
            worker_client.ssl_params()
            worker_client.ssl_params()
        self.assertFalse(m.called)
        self.assertFalse(o.called)

    def test_bounds_are_enforced(self):
        self.assertRaises(ValueError, self.config, prepare_timeout=0,
                          group='image_worker')
        self.assertRaises(ValueError, self.config, poll_interval=0.1,
                          group='image_worker')
        self.assertRaises(ValueError, self.config, reply_queue_type='lazy',
                          group='image_worker')


class BrokerSettingsTestCase(base.TestCase):
    """The worker's broker is ironic.conf's own."""

    def test_every_host_of_the_transport_url(self):
        self.config(transport_url='rabbit://u%40x:p%2Fw@h1:5671,'
                                  'u%40x:p%2Fw@[::1]:5672/ironic')
        urls, _ = worker_client.broker_urls()
        self.assertEqual(['amqp://u%40x:p%2Fw@h1:5671/ironic',
                          'amqp://u%40x:p%2Fw@[::1]:5672/ironic'], urls)

    def test_its_own_transport_url_wins(self):
        self.config(transport_url='rabbit://u:p@h1:5671/ironic')
        self.config(transport_url='rabbit://h2:5673,h3:5673/ironic',
                    group='image_worker')
        urls, _ = worker_client.broker_urls()
        self.assertEqual(['amqp://guest:guest@h2:5673/ironic',
                          'amqp://guest:guest@h3:5673/ironic'], urls)

    def test_no_tls_unless_oslo_messaging_rabbit_says_so(self):
        self.config(transport_url='rabbit://u:p@h1:5671/')
        _, parsed = worker_client.broker_urls()
        self.assertFalse(worker_client.ssl_params(parsed_url=parsed))

    def test_tls_from_oslo_messaging_rabbit(self):
        self.config(transport_url='rabbit://u:p@h1:5671/')
        _, parsed = worker_client.broker_urls()
        self.config(ssl=True, ssl_ca_file='/etc/ca.pem',
                    ssl_cert_file='/etc/c.pem', ssl_key_file='/etc/k.pem',
                    group='oslo_messaging_rabbit')
        params = worker_client.ssl_params(parsed_url=parsed)
        self.assertEqual('/etc/ca.pem', params['ca_certs'])
        self.assertEqual('/etc/c.pem', params['certfile'])
        self.assertEqual('/etc/k.pem', params['keyfile'])
