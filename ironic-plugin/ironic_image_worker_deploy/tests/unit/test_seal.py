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


"""The seal on commands and answers (``seal``), as docs/contract.md
documents it, and which answers the interface takes with it
(``client._answer_in``). The same on the real broker, behind a real
worker: ``tests/test_sealed.py``."""

import json
import logging
import os

import amqp
import fixtures as fx

from ironic_image_worker_deploy import client
from ironic_image_worker_deploy import seal
from ironic_image_worker_deploy.tests import base

# The golden vector the worker's own unit test (src/seal.rs) checks too.
VECTOR = os.path.join(os.path.dirname(__file__), '..', '..', '..', '..',
                      'tests', 'fixtures', 'seal_v1_vector.json')

NODE = '1be26c0b-6f3e-4a61-9d0e-7f1a2b3c4d5e'
REQUEST = 'req-1'
QUEUE = 'ironic-image-worker-deploy.reply.' + REQUEST
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _vector():
    with open(VECTOR) as f:
        return json.load(f)


def _done(**fields):
    done = {'action': 'prepare', 'status': 'success', 'node_uuid': NODE,
            'request_id': REQUEST,
            'image_url': 'http://192.0.2.10:8080/agent_images/' + NODE,
            'image_os_hash_algo': 'sha256', 'image_os_hash_value': 'a' * 64}
    done.update(fields)
    return done


def _message(done, key=None, queue=QUEUE, correlation_id=REQUEST):
    """An answer as the broker delivers it, sealed with ``key`` for
    ``queue`` and ``correlation_id`` when given."""
    body = json.dumps(done).encode()
    headers = {}
    if key is not None:
        headers[seal.HEADER] = seal.seal([key], 'answer', queue, None,
                                         correlation_id, body, 1, 0)
    return amqp.Message(body, correlation_id=REQUEST,
                        application_headers=headers)


class GoldenVectorTestCase(base.TestCase):

    def test_the_vector_seals_to_its_header(self):
        v = _vector()
        keys = seal.parse_keys(v['key'])
        self.assertEqual(v['key_id'], seal.key_id(keys[0]))
        header = seal.seal(keys, v['kind'], v['routing_key'], v['reply_to'],
                           v['correlation_id'], v['body'].encode(),
                           v['sealed_at'], v['valid_ms'])
        self.assertEqual(v['header'], header)
        self.assertIsNone(seal.check(
            keys, header, v['kind'], v['routing_key'], v['reply_to'],
            v['correlation_id'], v['body'].encode()))

    def test_the_seal_covers_every_field(self):
        v = _vector()
        keys = seal.parse_keys(v['key'])
        fields = [v['kind'], v['routing_key'], v['reply_to'],
                  v['correlation_id'], v['body'].encode()]
        for i, other in enumerate(['answer', 'x.node.prepare', None,
                                   'another', b'{}']):
            changed = list(fields)
            changed[i] = other
            self.assertEqual(seal.BAD_SEAL,
                             seal.check(keys, v['header'], *changed), i)
        self.assertEqual(seal.UNSEALED, seal.check(keys, None, *fields))
        for garbled in ('', '2:%s' % v['header'][2:],
                        v['header'].replace(':1800000:', ':01800000:')):
            self.assertEqual(seal.BAD_SEAL,
                             seal.check(keys, garbled, *fields))


class KeyFileTestCase(base.TestCase):

    def _file(self, text, mode=0o600):
        path = os.path.join(self.useFixture(fx.TempDir()).path, 'seal.key')
        with open(path, 'w') as f:
            f.write(text)
        os.chmod(path, mode)
        return path

    def test_one_or_two_hex_keys_of_32_bytes(self):
        new, old = KEY.hex(), OTHER_KEY.hex()
        self.assertEqual([KEY, OTHER_KEY], seal.read_keys(
            self._file('# current, then previous\n%s\n\n%s\n' % (new, old),
                       0o640)))
        for text, why in (('', 'no key'), ('zz', 'not a hex key'),
                          ('ab' * 31, '31 bytes'),
                          ('\n'.join([new] * 3), '3 keys')):
            e = self.assertRaises(seal.KeyFileError, seal.read_keys,
                                  self._file(text))
            self.assertIn(why, str(e))

    def test_a_file_others_may_read_or_the_group_change_is_refused(self):
        for mode in (0o644, 0o660, 0o604):
            e = self.assertRaises(seal.KeyFileError, seal.read_keys,
                                  self._file(KEY.hex(), mode))
            self.assertIn('mode %04o' % mode, str(e))

    def test_the_mode_defaults_to_require_with_a_key_file(self):
        path = self._file(KEY.hex())
        self.config(seal_secret_file=path, group='image_worker')
        policy = seal.Policy.from_conf(self.cfg_fixture.conf.image_worker)
        self.assertEqual(seal.REQUIRE, policy.mode)
        self.config(seal_secret_file=None, group='image_worker')
        policy = seal.Policy.from_conf(self.cfg_fixture.conf.image_worker)
        self.assertEqual(seal.OFF, policy.mode)
        self.config(seal='send', group='image_worker')
        self.assertRaises(seal.KeyFileError, seal.Policy.from_conf,
                          self.cfg_fixture.conf.image_worker)


class SealedAnswerTestCase(base.TestCase):
    """Anyone on the broker can publish to a reply queue: with a seal
    required, only the worker's answer sealed for this very request (its
    reply queue and correlation id) with a known key is taken."""

    def setUp(self):
        super().setUp()
        self.log = self.useFixture(fx.FakeLogger(level=logging.WARNING))
        client.LOG.logger.disabled = False

    def _taken(self, message, mode=seal.REQUIRE, keys=(KEY,)):
        policy = seal.Policy(list(keys), mode)
        return client._answer_in(message, 'prepare', NODE, REQUEST,
                                 policy=policy)

    def test_the_sealed_answer_is_taken(self):
        self.assertEqual(_done(), self._taken(_message(_done(), KEY)))
        # Sealed with the previous key while a new one goes round.
        self.assertEqual(_done(), self._taken(_message(_done(), OTHER_KEY),
                                              keys=(KEY, OTHER_KEY)))
        self.assertEqual('', self.log.output)

    def test_unsealed_and_forged_answers_are_skipped(self):
        # Each passes every check of answer.is_answer: only the seal tells.
        for message, why in (
                (_message(_done()), 'unsealed'),
                (_message(_done(), OTHER_KEY), 'bad_seal'),
                # A genuine seal made for another request's queue or id.
                (_message(_done(), KEY, queue=QUEUE + 'x'), 'bad_seal'),
                (_message(_done(), KEY, correlation_id='req-2'),
                 'bad_seal')):
            self.assertIsNone(self._taken(message))
            self.assertIn(why, self.log.output)
        self.assertIn('still waiting for the answer', self.log.output)

    def test_a_tampered_answer_is_skipped(self):
        message = _message(_done(), KEY)
        message.body = json.dumps(_done(image_url='http://192.0.2.66/' + NODE))
        self.assertIsNone(self._taken(message))

    def test_send_takes_unsealed_answers_but_never_forged_ones(self):
        self.assertEqual(_done(), self._taken(_message(_done()),
                                              mode=seal.SEND))
        self.assertIsNone(self._taken(_message(_done(), OTHER_KEY),
                                      mode=seal.SEND))
        # Off: the seal is not looked at.
        self.assertEqual(_done(), self._taken(_message(_done(), OTHER_KEY),
                                              mode=seal.OFF, keys=()))
