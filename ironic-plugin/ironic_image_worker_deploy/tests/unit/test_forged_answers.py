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


"""Which message is the worker's answer to a request (``answer.is_answer``)
and which source the worker passes through (``deploy.passed_through``).
Anyone on the broker can publish to a reply queue; the interface takes
only the answer to its own request. The same skipping on the real broker,
behind a real worker: ``tests/test_deploy.py``."""

import logging

import fixtures as fx

from ironic.tests.unit.objects import utils as obj_utils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import answer
from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy.tests import base

NODE = '1be26c0b-6f3e-4a61-9d0e-7f1a2b3c4d5e'
OTHER = '2ce26c0b-6f3e-4a61-9d0e-7f1a2b3c4d5e'
REQUEST = 'req-1'
SOURCE = 'https://user:s3cret@images.example/disk.qcow2?sig=t0ken'


def _done(**fields):
    done = {'action': 'prepare', 'status': 'success', 'node_uuid': NODE,
            'request_id': REQUEST,
            'image_url': 'http://192.0.2.10:8080/agent_images/' + NODE,
            'image_os_hash_algo': 'sha256', 'image_os_hash_value': 'a' * 64}
    done.update(fields)
    return done


class IsAnswerTestCase(base.TestCase):

    def setUp(self):
        super().setUp()
        self.log = self.useFixture(fx.FakeLogger(level=logging.WARNING))
        # The database fixture's migrations disable the loggers that exist.
        answer.LOG.logger.disabled = False

    def _is(self, done, action='prepare', source_url=None):
        return answer.is_answer(done, action, NODE, REQUEST, source_url)

    def test_the_answer_is_taken(self):
        self.assertTrue(self._is(_done()))
        self.assertTrue(self._is(_done(
            image_url='https://w.example/sub/' + NODE)))
        self.assertEqual('', self.log.output)

    def test_another_nodes_or_requests_answer_is_not(self):
        self.assertFalse(self._is(_done(node_uuid=OTHER)))
        self.assertFalse(self._is(_done(request_id='req-2')))
        self.assertFalse(self._is(_done(action='warm')))
        self.assertIn('node_uuid is', self.log.output)

    def test_a_success_elsewhere_is_not(self):
        for url in ('http://evil.example/disk.raw',
                    'http://192.0.2.10:8080/agent_images/' + OTHER,
                    'ftp://192.0.2.10/agent_images/' + NODE,
                    'file:///etc/agent_images/' + NODE, None, 7):
            self.assertFalse(self._is(_done(image_url=url)), url)

    def test_not_a_completion_is_not(self):
        for done in (None, [], 'text', 3):
            self.assertFalse(self._is(done))

    def test_errors_and_other_actions_carry_no_url(self):
        self.assertTrue(self._is(_done(status='error', image_url=None)))
        self.assertTrue(self._is(_done(action='cleanup', image_url=None),
                                 action='cleanup'))

    def test_a_passed_through_source_is_the_only_url(self):
        self.assertTrue(self._is(_done(image_url=SOURCE), source_url=SOURCE))
        self.assertFalse(self._is(_done(), source_url=SOURCE))

    def test_the_warning_names_no_credential(self):
        self.assertFalse(self._is(_done(
            image_url='http://mallory:hunter2@evil.example/x?k=secret')))
        self.assertIn('evil.example', self.log.output)
        for secret in ('hunter2', 'secret', 'a' * 64):
            self.assertNotIn(secret, self.log.output)


class PassedThroughTestCase(base.TestCase):

    def _node(self, source, mode):
        return obj_utils.create_test_node(
            self.context, uuid=uuidutils.generate_uuid(),
            instance_info={'image_source': source,
                           'image_download_source': mode})

    def test_an_http_source_in_http_mode(self):
        self.assertEqual(SOURCE, deploy.passed_through(
            self._node(' %s ' % SOURCE, 'http')))

    def test_anything_else_is_published(self):
        for source, mode in ((SOURCE, 'local'),
                             ('file:///images/disk.raw', 'http'),
                             ('oci://registry.example/disk:1', 'http'),
                             (uuidutils.generate_uuid(), 'http')):
            self.assertIsNone(deploy.passed_through(
                self._node(source, mode)), (source, mode))
