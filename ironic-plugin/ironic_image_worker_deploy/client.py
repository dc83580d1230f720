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

"""Commands to ironic-image-worker over RabbitMQ, answered on a reply queue.

One short-lived connection per command: the conductor sends few of them (one
per deploy step that needs the worker) and a fresh connection has no state
to go stale between deploys. A command is published with publisher confirms
and ``mandatory`` set, so a command that no worker queue can take is known
at once instead of at the deadline.
"""

import json
import socket
import ssl
import time
from urllib import parse as urlparse

import amqp
import kombu
from kombu import exceptions as kombu_exc
from oslo_config import cfg
from oslo_log import log
import oslo_messaging
from oslo_messaging import opts as messaging_opts
from oslo_utils import strutils
from oslo_utils import uuidutils

from ironic_image_worker_deploy import conf as worker_conf
from ironic_image_worker_deploy import exception

LOG = log.getLogger(__name__)

CONF = cfg.CONF

_RABBIT_GROUP = 'oslo_messaging_rabbit'

# Failures of the connection or of the channel: the broker, not the worker.
_BROKER_ERRORS = (OSError, kombu_exc.KombuError, amqp.exceptions.AMQPError)


def _register_rabbit_opts(conf):
    """Make sure [oslo_messaging_rabbit] is readable.

    The conductor registers these options when its RPC transport loads the
    rabbit driver; a process that uses this module alone (a tool, a test)
    has not, so register oslo.messaging's own definitions.
    """
    for group, opts in messaging_opts.list_opts():
        if group == _RABBIT_GROUP:
            conf.register_opts(opts, group=group)


def broker_urls(conf=CONF):
    """AMQP URLs of every broker host of the worker's transport URL.

    Uses ``[image_worker]transport_url`` or else ``[DEFAULT]transport_url``,
    parsed by oslo.messaging itself (``rabbit://u:p@h1:5672,u:p@h2:5672/vh``
    gives one URL per host, in order).
    """
    url = conf.image_worker.transport_url
    parsed = oslo_messaging.TransportURL.parse(conf, url or None)
    vhost = urlparse.quote(parsed.virtual_host or '', safe='')
    urls = []
    for host in parsed.hosts:
        urls.append('amqp://%(user)s:%(password)s@%(host)s:%(port)s/%(vhost)s'
                    % {'user': urlparse.quote(host.username or 'guest',
                                              safe=''),
                       'password': urlparse.quote(host.password or 'guest',
                                                  safe=''),
                       'host': _bracket_ipv6(host.hostname or 'localhost'),
                       'port': host.port or 5672,
                       'vhost': vhost})
    if not urls:
        urls.append('amqp://guest:guest@localhost:5672/%s' % vhost)
    return urls, parsed


def _bracket_ipv6(hostname):
    return '[%s]' % hostname if ':' in hostname else hostname


def ssl_params(conf=CONF, parsed_url=None):
    """TLS settings for kombu from [oslo_messaging_rabbit], as the conductor's
    own RPC connection uses them (``ssl``, ``ssl_ca_file``,
    ``ssl_cert_file``, ``ssl_key_file``, ``ssl_version``); also enabled by
    ``?ssl=1`` in the transport URL."""
    _register_rabbit_opts(conf)
    rabbit = conf[_RABBIT_GROUP]
    enabled = rabbit.ssl
    if parsed_url is not None and 'ssl' in (parsed_url.query or {}):
        enabled = strutils.bool_from_string(parsed_url.query['ssl'])
    if not enabled:
        return False
    params = {}
    if rabbit.ssl_version:
        params['ssl_version'] = getattr(ssl,
                                        'PROTOCOL_%s' % rabbit.ssl_version)
    if rabbit.ssl_key_file:
        params['keyfile'] = rabbit.ssl_key_file
    if rabbit.ssl_cert_file:
        params['certfile'] = rabbit.ssl_cert_file
    if rabbit.ssl_ca_file:
        params['ca_certs'] = rabbit.ssl_ca_file
        params['cert_reqs'] = ssl.CERT_REQUIRED
    return params or True


class WorkerClient(object):
    """Sends commands to the image worker of one conductor host."""

    def __init__(self, conf=CONF):
        self.conf = conf
        self.group = conf[worker_conf.GROUP]

    @property
    def host(self):
        """The worker's [DEFAULT]host: the routing key's first word."""
        return self.group.conductor_host or self.conf.host

    def _connect(self, node_uuid):
        urls, parsed = broker_urls(self.conf)
        connection = kombu.Connection(
            ';'.join(urls),
            ssl=ssl_params(self.conf, parsed),
            connect_timeout=self.group.connect_timeout,
            failover_strategy='round-robin',
            transport_options={'confirm_publish': True})

        def _failed(exc, interval):
            LOG.warning('Cannot connect to the image worker broker for node '
                        '%(node)s: %(exc)s', {'node': node_uuid, 'exc': exc})

        try:
            # One attempt per host of the URL, then give up.
            connection.ensure_connection(errback=_failed,
                                         max_retries=len(urls),
                                         interval_start=0, interval_step=0.5,
                                         interval_max=1)
        except _BROKER_ERRORS as e:
            connection.release()
            raise exception.ImageWorkerBrokerUnreachable(node=node_uuid,
                                                         reason=str(e))
        return connection

    def call(self, action, node_uuid, instance_info=None, options=None,
             timeout=None, expire=False):
        """Send a command and wait for its completion event.

        :param action: ``prepare``, ``deployed`` or ``cleanup``.
        :param node_uuid: the node's UUID.
        :param instance_info: the command's ``instance_info`` (prepare).
        :param options: the command's ``options`` (force_raw, stream_raw).
        :param timeout: seconds to wait for the answer; None waits not at
            all and returns None once the broker has the command.
        :param expire: let the broker drop (dead-letter) the command when
            no worker took it within ``timeout``.
        :returns: the completion event (a dict), whatever its status.
        :raises: ImageWorkerBrokerUnreachable, ImageWorkerNotListening,
            ImageWorkerTimeout
        """
        body = {'action': action, 'node_uuid': node_uuid,
                'request_id': uuidutils.generate_uuid()}
        if instance_info is not None:
            body['instance_info'] = instance_info
        if options:
            body['options'] = options
        routing_key = '%s.node.%s' % (self.host, action)
        exchange = self.group.exchange
        correlation_id = body['request_id']
        found = []
        returned = []

        connection = self._connect(node_uuid)
        try:
            channel = connection.channel()
            # When it was issued: the worker refuses a prepare older than
            # a later cleanup of the node (stale_request).
            sent = time.time()
            properties = {'content_type': 'application/json',
                          'delivery_mode': 2,
                          'correlation_id': correlation_id,
                          'application_headers': {
                              'timestamp_in_ms': int(sent * 1000)}}
            if timeout is not None:
                reply_queue, _, _ = channel.queue_declare(
                    queue='', exclusive=True, auto_delete=True)

                def _on_reply(message):
                    if message.properties.get(
                            'correlation_id') == correlation_id:
                        found.append(message.body)

                channel.basic_consume(queue=reply_queue, no_ack=True,
                                      callback=_on_reply)
                properties['reply_to'] = reply_queue
                if expire:
                    properties['expiration'] = str(int(timeout * 1000))

            channel.events['basic_return'].add(
                lambda exc, exch, key, message: returned.append(exc))
            LOG.debug('Sending %(action)s for node %(node)s to the image '
                      'worker (%(exchange)s, %(key)s, request %(req)s)',
                      {'action': action, 'node': node_uuid,
                       'exchange': exchange, 'key': routing_key,
                       'req': correlation_id})
            try:
                channel.basic_publish(
                    amqp.Message(json.dumps(body), **properties),
                    exchange=exchange, routing_key=routing_key,
                    mandatory=True)
            except amqp.exceptions.NotFound:
                returned.append('no exchange')
            if returned:
                raise exception.ImageWorkerNotListening(
                    node=node_uuid, host=self.host, exchange=exchange,
                    routing_key=routing_key)
            if timeout is None:
                return None

            deadline = time.monotonic() + timeout
            while not found:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise exception.ImageWorkerTimeout(
                        node=node_uuid, host=self.host, action=action,
                        timeout=timeout)
                try:
                    connection.drain_events(timeout=left)
                except socket.timeout:
                    continue
            event = json.loads(found[0])
            LOG.debug('Image worker answered %(action)s for node %(node)s: '
                      '%(status)s', {'action': action, 'node': node_uuid,
                                     'status': event.get('status')})
            return event
        except exception.ImageWorkerError:
            raise
        except _BROKER_ERRORS as e:
            raise exception.ImageWorkerBrokerUnreachable(node=node_uuid,
                                                         reason=str(e))
        finally:
            try:
                connection.release()
            except Exception:  # noqa: the command's outcome is known
                LOG.debug('Closing the image worker connection failed',
                          exc_info=True)
