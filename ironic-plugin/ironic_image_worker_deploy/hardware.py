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


"""Hardware types that list ``direct-worker``, registered under
``ironic.hardware.types``: Ironic's own generic types, each with
``direct-worker`` first among its deploy interfaces (so it is their default
deploy interface when enabled and ``[DEFAULT]default_deploy_interface`` is
not set). Everything else (power, management, boot, ...) is the in-tree
type's: a node moves to one with ``baremetal node set --driver
redfish-worker`` and keeps its ``driver_info``. Ironic's own hardware types
are left as they are (see supported.py for deployments that cannot choose a
node's hardware type).
"""

from ironic.drivers import drac
from ironic.drivers import generic
from ironic.drivers import intel_ipmi
from ironic.drivers import ipmi
from ironic.drivers import redfish

from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy import supported


class _ListsDirectWorker:
    """Lists ``direct-worker`` first, then the in-tree type's interfaces."""

    @property
    def supported_deploy_interfaces(self):
        """List of supported deploy interfaces."""
        return supported.with_interface(super().supported_deploy_interfaces,
                                        deploy.DirectWorkerDeploy, first=True)


class IPMIWorkerHardware(_ListsDirectWorker, ipmi.IPMIHardware):
    """``ipmi`` with ``direct-worker`` (entry point ``ipmi-worker``)."""


class IntelIPMIWorkerHardware(_ListsDirectWorker,
                              intel_ipmi.IntelIPMIHardware):
    """``intel-ipmi`` with ``direct-worker`` (``intel-ipmi-worker``)."""


class RedfishWorkerHardware(_ListsDirectWorker, redfish.RedfishHardware):
    """``redfish`` with ``direct-worker`` (``redfish-worker``)."""


class IDRACWorkerHardware(_ListsDirectWorker, drac.IDRACHardware):
    """``idrac`` with ``direct-worker`` (``idrac-worker``)."""


class ManualManagementWorkerHardware(_ListsDirectWorker,
                                     generic.ManualManagementHardware):
    """``manual-management`` with ``direct-worker``
    (``manual-management-worker``)."""
