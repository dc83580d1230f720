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

"""A stand-in worker on the real broker, for answers the worker under test
does not give in this checkout (an ``oci://`` source): it consumes one
host's commands from a queue named as the worker names its own, records
them and answers each with what ``answer(command)`` returns, to
``reply_to`` with the command's ``correlation_id``, as the worker does."""

import json
import threading

import amqp
import kombu


class FakeWorker(object):
    """Consumes ``<host>.node.*`` on ``exchange`` until stopped."""

    def __init__(self, broker_url, exchange, host, answer):
        self.commands = []
        self.queue = 'ironic-image-worker.%s' % host
        self._answer = answer
        self._conn = kombu.Connection(broker_url)
        self._conn.connect()
        channel = self._conn.channel()
        channel.exchange_declare(exchange, 'topic', durable=True,
                                 auto_delete=False)
        channel.queue_declare(self.queue, auto_delete=True)
        channel.queue_bind(self.queue, exchange, '%s.node.*' % host)
        channel.basic_consume(self.queue, callback=self._on_command)
        self._channel = channel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_command(self, message):
        command = json.loads(message.body)
        self.commands.append(command)
        done = self._answer(command)
        reply_to = message.properties.get('reply_to')
        if reply_to:
            self._channel.basic_publish(
                amqp.Message(json.dumps(done), correlation_id=message
                             .properties.get('correlation_id'),
                             content_type='application/json'),
                exchange='', routing_key=reply_to)
        self._channel.basic_ack(message.delivery_tag)

    def _run(self):
        while not self._stop.is_set():
            try:
                self._conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        self._conn.release()
