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

"""Lists ``direct-worker`` wherever a hardware type lists ``direct``.

Ironic accepts an interface for a hardware type only when the interface's
exact class is in the type's ``supported_deploy_interfaces`` list
(``type(iface) in supported`` in ``driver_factory.get_interface`` and
``enabled_supported_interfaces``), and picks the default interface by
looking classes up in a dict keyed by class (``default_interface``). A
subclass of ``AgentDeploy`` therefore passes no ``isinstance`` test there,
and no class can compare equal to ``AgentDeploy`` without also hashing like
it, which would merge ``direct`` and ``direct-worker`` in that dict. So the
lists themselves name the interface: every in-tree hardware type (ipmi,
redfish, idrac, ilo, manual-management, fake-hardware, ...) gets its list
from ``GenericHardware.supported_deploy_interfaces``, which is wrapped once
to add ``direct-worker`` right after ``direct``. Ironic loads the enabled
deploy interfaces (this package among them) before it registers the
conductor's hardware interfaces, so the registration sees the longer list.
A hardware type outside Ironic that writes its own list without calling
``GenericHardware``'s does not get ``direct-worker``.
"""

from ironic.drivers import generic
from ironic.drivers.modules import agent

_MARK = '_lists_direct_worker'


def with_interface(classes, interface_class):
    """``classes`` with ``interface_class`` after ``AgentDeploy``, if there."""
    classes = list(classes)
    if agent.AgentDeploy in classes and interface_class not in classes:
        classes.insert(classes.index(agent.AgentDeploy) + 1,
                       interface_class)
    return classes


def accept_where_direct_is(interface_class):
    """Make GenericHardware and its subclasses list ``interface_class``.

    Idempotent: a second call (a reload of the module) changes nothing.
    """
    listed = generic.GenericHardware.__dict__['supported_deploy_interfaces']
    if getattr(listed.fget, _MARK, False):
        return

    def supported_deploy_interfaces(self):
        return with_interface(listed.fget(self), interface_class)

    setattr(supported_deploy_interfaces, _MARK, True)
    supported_deploy_interfaces.__doc__ = listed.__doc__
    generic.GenericHardware.supported_deploy_interfaces = property(
        supported_deploy_interfaces)
