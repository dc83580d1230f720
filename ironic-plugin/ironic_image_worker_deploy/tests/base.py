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


"""The test case every test of the plug-in derives from."""

from ironic.tests.unit.db import base as db_base


class TestCase(db_base.DbTestCase):
    """Ironic's database test case (sqlite, its own fixtures and
    configuration reset), run by pytest."""

    # The deploy tests run qemu-img and the agent's download code, and
    # loading Ironic's hardware types runs tools too.
    block_execute = False

    def setUp(self):
        super().setUp()
        # Ironic's test defaults, with this package's interface enabled.
        self.config(enabled_deploy_interfaces=[
            'fake', 'direct', 'direct-worker', 'ramdisk', 'anaconda'])

    def _clear_attrs(self):
        # Ironic's clean-up drops every public attribute, pytest's own
        # reference to the test method included; keep them.
        pass
