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


"""Which hardware types list ``direct-worker`` among their deploy interfaces.

Ironic accepts a deploy interface for a node only when the interface's exact
class is in its hardware type's ``supported_deploy_interfaces``
(``type(iface) in supported`` in ``driver_factory.get_interface`` and
``enabled_supported_interfaces``); no configuration option adds one. The
route Ironic offers code outside its tree is a hardware type of its own
(see hardware.py), which this module's ``with_interface`` builds.

Some deployments cannot choose a node's hardware type: Metal3's
baremetal-operator derives it from the BMC address (``redfish``, ``ipmi``,
``idrac``). For them, and only when the operator names them in
``[image_worker]extend_hardware_types``, ``accept_in`` makes those in-tree
hardware types (and their subclasses) list ``direct-worker`` right after
``direct``, so ``direct`` stays their default. Nothing changes when the
option is empty, which is its default.
"""

import importlib.metadata

from ironic.common import exception as ironic_exception
from ironic.common.i18n import _
from ironic.drivers.modules import agent

HARDWARE_TYPES = 'ironic.hardware.types'

# Marks a property this module made, holding the one it wraps.
_WRAPPED = '_direct_worker_wraps'


def with_interface(classes, interface_class, first=False):
    """``classes`` listing ``interface_class`` once: first, or right after
    ``AgentDeploy`` (``direct``) when that is listed."""
    classes = [c for c in classes if c is not interface_class]
    if first:
        return [interface_class] + classes
    if agent.AgentDeploy in classes:
        classes.insert(classes.index(agent.AgentDeploy) + 1,
                       interface_class)
    return classes


def hardware_type_class(name):
    """The class Ironic loads for the hardware type ``name``.

    :raises: InvalidParameterValue naming the option and the known types
        when no installed package registers ``name``.
    """
    found = importlib.metadata.entry_points(group=HARDWARE_TYPES, name=name)
    for entry_point in found:
        return entry_point.load()
    known = sorted(ep.name for ep in
                   importlib.metadata.entry_points(group=HARDWARE_TYPES))
    raise ironic_exception.InvalidParameterValue(_(
        "[image_worker]extend_hardware_types names %(name)s, which is not "
        "a hardware type (known: %(known)s)") % {
            'name': name, 'known': ', '.join(known)})


def accept_in(names, interface_class):
    """Make the hardware types ``names`` list ``interface_class`` after
    ``direct``; idempotent.

    :returns: the classes changed by this call (none on a second call).
    :raises: InvalidParameterValue for a name that is not a hardware type.
    """
    changed = []
    for cls in [hardware_type_class(name) for name in names]:
        listed = cls().supported_deploy_interfaces
        if interface_class in listed:
            continue
        changed.append(cls)
        original = cls.__dict__.get('supported_deploy_interfaces')
        inherited = _inherited_property(cls)

        def supported_deploy_interfaces(self, _inherited=inherited):
            return with_interface(_inherited.fget(self), interface_class)

        setattr(supported_deploy_interfaces, _WRAPPED, original)
        supported_deploy_interfaces.__doc__ = inherited.__doc__
        cls.supported_deploy_interfaces = property(
            supported_deploy_interfaces)
    return changed


def withdraw(cls):
    """Undo ``accept_in`` on ``cls`` (for tests); nothing if not done."""
    prop = cls.__dict__.get('supported_deploy_interfaces')
    if prop is None or not hasattr(prop.fget, _WRAPPED):
        return
    original = getattr(prop.fget, _WRAPPED)
    if original is None:
        del cls.supported_deploy_interfaces
    else:
        cls.supported_deploy_interfaces = original


def _inherited_property(cls):
    """The ``supported_deploy_interfaces`` property ``cls`` answers with."""
    for klass in cls.__mro__:
        if 'supported_deploy_interfaces' in klass.__dict__:
            return klass.__dict__['supported_deploy_interfaces']
    raise TypeError('%s is not a hardware type' % cls.__name__)
