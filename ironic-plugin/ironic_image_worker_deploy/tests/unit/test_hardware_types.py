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


"""How Ironic finds ``direct-worker``: its entry point, the package's
hardware types, and the opt-in for Ironic's own types
(``[image_worker]extend_hardware_types``), through Ironic's driver
factory."""

import importlib.metadata

from ironic.common import driver_factory
from ironic.common import exception as ironic_exception
from ironic.conductor import task_manager
from ironic.drivers import drac
from ironic.drivers import generic
from ironic.drivers import ipmi
from ironic.drivers.modules import agent
from ironic.drivers import redfish
from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy import hardware
from ironic_image_worker_deploy import supported
from ironic_image_worker_deploy.tests import base

OWN_TYPES = {
    'ipmi-worker': hardware.IPMIWorkerHardware,
    'intel-ipmi-worker': hardware.IntelIPMIWorkerHardware,
    'redfish-worker': hardware.RedfishWorkerHardware,
    'idrac-worker': hardware.IDRACWorkerHardware,
    'manual-management-worker': hardware.ManualManagementWorkerHardware,
}

IN_TREE = ('ipmi', 'intel-ipmi', 'redfish', 'idrac', 'manual-management')


def _deploy_interfaces(name):
    """The deploy interfaces Ironic accepts for hardware type ``name``."""
    hw_type = driver_factory.get_hardware_type(name)
    return driver_factory.enabled_supported_interfaces(hw_type)['deploy']


class _Case(base.TestCase):

    def setUp(self):
        super().setUp()
        self.config(enabled_hardware_types=list(IN_TREE) + list(OWN_TYPES))
        # Ironic's own types as they were, whatever a test opted in.
        for name in IN_TREE:
            self.addCleanup(supported.withdraw,
                            supported.hardware_type_class(name))


class EntryPointsTestCase(_Case):

    def test_deploy_interface_entry_point(self):
        [entry_point] = importlib.metadata.entry_points(
            group='ironic.hardware.interfaces.deploy', name='direct-worker')
        self.assertIs(deploy.DirectWorkerDeploy, entry_point.load())

    def test_hardware_type_entry_points(self):
        found = {ep.name: ep.load() for ep in importlib.metadata.entry_points(
            group=supported.HARDWARE_TYPES) if ep.name in OWN_TYPES}
        self.assertEqual(OWN_TYPES, found)

    def test_ironic_loads_it_by_name(self):
        iface = driver_factory.get_interface(
            driver_factory.get_hardware_type('redfish-worker'), 'deploy',
            'direct-worker')
        self.assertIsInstance(iface, deploy.DirectWorkerDeploy)

    def test_not_loaded_unless_enabled(self):
        self.config(enabled_deploy_interfaces=['fake', 'direct'])
        self.assertRaises(ironic_exception.InterfaceNotFoundInEntrypoint,
                          driver_factory.get_interface,
                          driver_factory.get_hardware_type('redfish-worker'),
                          'deploy', 'direct-worker')


class OwnHardwareTypesTestCase(_Case):

    def test_each_accepts_direct_worker(self):
        for name in OWN_TYPES:
            self.assertIn('direct-worker', _deploy_interfaces(name), name)

    def test_each_accepts_what_its_in_tree_type_accepts(self):
        for name in OWN_TYPES:
            self.assertEqual(_deploy_interfaces(name[:-len('-worker')])
                             | {'direct-worker'}, _deploy_interfaces(name))

    def test_is_the_in_tree_type_otherwise(self):
        self.assertIsInstance(hardware.RedfishWorkerHardware(),
                              redfish.RedfishHardware)
        self.assertIsInstance(hardware.IDRACWorkerHardware(),
                              drac.IDRACHardware)
        self.assertEqual(redfish.RedfishHardware().supported_power_interfaces,
                         hardware.RedfishWorkerHardware()
                         .supported_power_interfaces)

    def test_direct_worker_is_their_default(self):
        for name in OWN_TYPES:
            self.assertEqual('direct-worker', driver_factory.default_interface(
                driver_factory.get_hardware_type(name), 'deploy',
                driver_name=name))

    def test_default_deploy_interface_option_wins(self):
        self.config(default_deploy_interface='direct')
        self.assertEqual('direct', driver_factory.default_interface(
            driver_factory.get_hardware_type('ipmi-worker'), 'deploy'))

    def test_ironics_own_types_are_left_alone(self):
        deploy.DirectWorkerDeploy()
        for name in IN_TREE:
            self.assertNotIn('direct-worker', _deploy_interfaces(name), name)
        self.assertNotIn(deploy.DirectWorkerDeploy,
                         generic.GenericHardware.supported_deploy_interfaces
                         .fget(ipmi.IPMIHardware()))

    def test_a_node_on_one_gets_the_interface(self):
        node = obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='manual-management-worker',
            deploy_interface='direct-worker', boot_interface='pxe',
            power_interface='fake', management_interface='fake',
            network_interface='noop')
        with task_manager.acquire(self.context, node.uuid) as task:
            self.assertIsInstance(task.driver.deploy,
                                  deploy.DirectWorkerDeploy)

    def test_a_node_on_an_in_tree_type_is_refused(self):
        node = obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            driver='manual-management', deploy_interface='fake',
            boot_interface='pxe', power_interface='fake',
            management_interface='fake', network_interface='noop')
        node.deploy_interface = 'direct-worker'
        self.assertRaises(ironic_exception.IncompatibleInterface,
                          driver_factory.check_and_update_node_interfaces,
                          node)


class ExtendHardwareTypesTestCase(_Case):
    """``[image_worker]extend_hardware_types``: the opt-in for deployments
    that cannot choose a node's hardware type."""

    def _load(self, *names):
        self.config(extend_hardware_types=list(names), group='image_worker')
        # As the conductor does at start: interfaces first, then the
        # hardware types' lists.
        driver_factory.all_interfaces()

    def test_named_types_accept_it_after_direct(self):
        self._load('redfish', 'ipmi')
        for name in ('redfish', 'ipmi', 'idrac', 'intel-ipmi'):
            self.assertIn('direct-worker', _deploy_interfaces(name), name)
        listed = redfish.RedfishHardware().supported_deploy_interfaces
        self.assertEqual(listed.index(agent.AgentDeploy) + 1,
                         listed.index(deploy.DirectWorkerDeploy))

    def test_other_types_do_not(self):
        self._load('redfish')
        self.assertNotIn('direct-worker', _deploy_interfaces('ipmi'))
        self.assertNotIn('direct-worker',
                         _deploy_interfaces('manual-management'))

    def test_direct_stays_their_default(self):
        self._load('ipmi')
        self.assertEqual('direct', driver_factory.default_interface(
            driver_factory.get_hardware_type('ipmi'), 'deploy'))

    def test_the_only_deploy_interface_enabled_is_the_default(self):
        self.config(enabled_deploy_interfaces=['direct-worker', 'ramdisk'])
        self._load('ipmi')
        self.assertEqual('direct-worker', driver_factory.default_interface(
            driver_factory.get_hardware_type('ipmi'), 'deploy'))

    def test_listed_once_however_often_loaded(self):
        self._load('manual-management')
        self.assertEqual([], supported.accept_in(
            ['manual-management'], deploy.DirectWorkerDeploy))
        deploy.DirectWorkerDeploy()
        listed = generic.ManualManagementHardware().supported_deploy_interfaces
        self.assertEqual(1, listed.count(deploy.DirectWorkerDeploy))

    def test_unknown_name_fails_the_loading_naming_the_option(self):
        self.config(extend_hardware_types=['redfsh'], group='image_worker')
        e = self.assertRaises(ironic_exception.DriverLoadError,
                              driver_factory.all_interfaces)
        self.assertIn('[image_worker]extend_hardware_types', str(e))
        self.assertIn('redfsh', str(e))

    def test_withdrawn_as_it_was(self):
        self._load('redfish')
        supported.withdraw(redfish.RedfishHardware)
        self.assertNotIn('supported_deploy_interfaces',
                         redfish.RedfishHardware.__dict__)
        self.assertNotIn('direct-worker', _deploy_interfaces('redfish'))

    def test_a_class_of_its_own(self):
        # Python's contract: equal objects hash alike. direct-worker is
        # neither equal to direct nor merged with it in a dict or set.
        self.assertNotEqual(agent.AgentDeploy, deploy.DirectWorkerDeploy)
        self.assertEqual(2, len({agent.AgentDeploy,
                                 deploy.DirectWorkerDeploy}))
