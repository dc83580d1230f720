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

from ironic_image_worker_deploy import answer
from ironic_image_worker_deploy import conf as worker_conf
from ironic_image_worker_deploy import exception
from ironic_image_worker_deploy import seal

LOG = log.getLogger(__name__)

CONF = cfg.CONF

_RABBIT_GROUP = 'oslo_messaging_rabbit'

# Failures of the connection or of the channel: the broker, not the worker.
_BROKER_ERRORS = (OSError, kombu_exc.KombuError, amqp.exceptions.AMQPError)


# The configuration objects whose [oslo_messaging_rabbit] is registered.
_RABBIT_REGISTERED = set()


def _register_rabbit_opts(conf):
    """Make sure [oslo_messaging_rabbit] is readable.

    The conductor registers these options when its RPC transport loads the
    rabbit driver; a process that uses this module alone (a tool, a test)
    has not, so register oslo.messaging's own definitions.
    """
    if id(conf) in _RABBIT_REGISTERED:
        return
    for group, opts in messaging_opts.list_opts():
        if group == _RABBIT_GROUP:
            conf.register_opts(opts, group=group)
    _RABBIT_REGISTERED.add(id(conf))


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


# How often a waiting command wakes up to send heartbeats and, every
# _CONSUMER_CHECK_EVERY, to look at the worker queue's consumers.
_TICK = 1.0
_CONSUMER_CHECK_EVERY = 5.0
# How long a reply queue outlives its last use beyond the command's
# deadline (the broker deletes it then, should this process be gone).
_REPLY_QUEUE_SLACK = 60
_REPLY_QUEUE_LENGTH = 16


# The longest pause between two re-asks of one command.
_REASK_MAX = 300


class Reasks(object):
    """When a command still without its answer is sent again: ``first``
    seconds after ``start``, then after twice as long each time, at most
    every ``_REASK_MAX`` seconds ([image_worker]reask_after; 0: never)."""

    def __init__(self, first, start):
        self.pause = first
        self.due_at = start + first if first else None

    def due(self, now):
        """Whether to ask again at ``now``; if so, the next one is set."""
        if self.due_at is None or now < self.due_at:
            return False
        self.pause = min(self.pause * 2, _REASK_MAX)
        self.due_at = now + self.pause
        return True


class _Reply(object):
    """The reply queue of one command: named after the request, durable and
    not exclusive, so it outlives the connection (and, as a quorum queue,
    the broker node) it was declared on, expiring (``x-expires``) once
    unused so it never outlives the wait by long, and holding a few
    messages at most (``x-max-length``)."""

    def __init__(self, request_id, queue_type, timeout):
        self.name = 'ironic-image-worker-deploy.reply.%s' % request_id
        self.arguments = {
            'x-queue-type': queue_type,
            'x-expires': int((timeout + _REPLY_QUEUE_SLACK) * 1000),
            # One answer is expected; anything beyond is dropped.
            'x-max-length': _REPLY_QUEUE_LENGTH}
        self.found = []

    def declare(self, connection):
        """Declare the queue; returns the channel it was declared on."""
        channel = connection.channel()
        channel.queue_declare(queue=self.name, durable=True,
                              exclusive=False, auto_delete=False,
                              arguments=self.arguments)
        return channel

    def attach(self, connection, accept):
        """Declare the queue (again, after a reconnection) and consume it,
        keeping the completions ``accept(message)`` returns (the answer;
        None for any other message, which is dropped)."""
        channel = self.declare(connection)

        def _on_reply(message):
            done = accept(message)
            if done is not None:
                self.found.append(done)
            channel.basic_ack(message.delivery_tag)

        channel.basic_consume(queue=self.name, callback=_on_reply)
        return channel

    def delete(self, connection):
        """Best effort: the queue expires by itself anyway."""
        try:
            connection.channel().queue_delete(queue=self.name)
        except Exception:  # noqa: the command's outcome is known
            LOG.debug('Deleting reply queue %s failed', self.name,
                      exc_info=True)


class WorkerClient(object):
    """Sends commands to the image worker of one conductor host."""

    def __init__(self, conf=CONF):
        self.conf = conf
        self.group = conf[worker_conf.GROUP]

    def _seal_policy(self, node_uuid):
        """The seal policy of ``[image_worker]``, its key file read now
        (so a rotated key is used at once).

        :raises: ImageWorkerSealKeyError
        """
        try:
            return seal.Policy.from_conf(self.group)
        except seal.KeyFileError as e:
            raise exception.ImageWorkerSealKeyError(node=node_uuid,
                                                    reason=str(e))

    @property
    def host(self):
        """The worker's [DEFAULT]host: the routing key's first word."""
        return self.group.conductor_host or self.conf.host

    @property
    def queue(self):
        """The worker's command queue (``<queue_prefix>.<host>``)."""
        return '%s.%s' % (self.group.queue_prefix, self.host)

    def _connect(self, node_uuid):
        urls, parsed = broker_urls(self.conf)
        ssl_options = ssl_params(self.conf, parsed)
        connection = kombu.Connection(
            ';'.join(urls),
            ssl=ssl_options,
            connect_timeout=self.group.connect_timeout,
            heartbeat=self.conf[_RABBIT_GROUP].heartbeat_timeout_threshold,
            failover_strategy='round-robin',
            transport_options={
                'confirm_publish': True,
                # Shown by the broker (rabbitmqctl list_connections).
                'client_properties': {
                    'connection_name': 'ironic-image-worker-deploy %s'
                                       % node_uuid}})

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

    def _reconnect(self, connection, node_uuid, deadline, error):
        """A new connection after ``error``, tried until ``deadline``."""
        LOG.warning('Lost the image worker broker connection while waiting '
                    'for node %(node)s, reconnecting: %(error)s',
                    {'node': node_uuid, 'error': error})
        _release(connection)
        while True:
            try:
                return self._connect(node_uuid)
            except exception.ImageWorkerBrokerUnreachable as e:
                if time.monotonic() + _TICK >= deadline:
                    e.sent = True
                    raise
                time.sleep(_TICK)

    def consumers(self, connection):
        """Consumers of the worker queue, or None when it has another name.

        A passive declare on a channel of its own (a missing queue closes
        the channel). An exclusive queue of another connection is someone's
        who is there: unknown too.
        """
        channel = connection.channel()
        try:
            _, _, count = channel.queue_declare(queue=self.queue,
                                                passive=True)
            return count
        except (amqp.exceptions.NotFound, amqp.exceptions.ResourceLocked):
            return None
        finally:
            _release(channel)

    def _await_consumer(self, connection, node_uuid, limit=None):
        """Wait up to [image_worker]worker_restart_grace (never beyond
        ``limit`` seconds, the command's own timeout) for a consumer.

        :raises: ImageWorkerNotConsuming when none came.
        """
        grace = self.group.worker_restart_grace
        if limit is not None:
            grace = min(grace, limit)
        until = time.monotonic() + grace
        while self.consumers(connection) == 0:
            if time.monotonic() >= until:
                raise exception.ImageWorkerNotConsuming(
                    node=node_uuid, host=self.host, queue=self.queue,
                    grace=grace)
            connection.heartbeat_check()
            time.sleep(min(_TICK, grace))

    def _publish(self, channel, body, properties, routing_key, policy=None,
                 valid=None):
        """Publish with confirms, sealed under ``policy``; False when no
        queue could take it.

        A sealed command stays valid for ``valid`` seconds (its wait), and
        never less than [image_worker]prepare_timeout: a deployed or a
        cleanup may wait in the queue behind prepares, and the worker
        still acts on it when it comes to it.
        """
        returned = []
        channel.events['basic_return'].add(
            lambda exc, exch, key, message: returned.append(exc))
        data = json.dumps(body).encode('utf-8')
        if policy is not None and policy.sealing:
            properties['application_headers'][seal.HEADER] = seal.seal(
                policy.keys, 'command', routing_key,
                properties.get('reply_to'), properties['correlation_id'],
                data, int(time.time() * 1000),
                int(max(valid or 0, self.group.prepare_timeout) * 1000))
        try:
            channel.basic_publish(
                amqp.Message(data, **properties),
                exchange=self.group.exchange, routing_key=routing_key,
                mandatory=True)
        except amqp.exceptions.NotFound:
            return False
        return not returned

    def _wait(self, link, reply, accept, deadline, node_uuid, reask=None):
        """Wait for the answer on ``reply`` (attached on ``link[0]``, taking
        what ``accept`` takes), calling ``reask()`` (the command sent again)
        whenever ``Reasks`` says so.

        A failed connection is replaced (``link[0]``) and the reply queue
        re-attached, until ``deadline``: the worker's answer waits in the
        queue meanwhile. A worker queue without consumers for longer than
        [image_worker]worker_restart_grace ends the wait early.

        :raises: ImageWorkerTimeout, ImageWorkerNotConsuming,
            ImageWorkerBrokerUnreachable
        """
        grace = self.group.worker_restart_grace
        idle_since = None
        next_check = time.monotonic() + min(_CONSUMER_CHECK_EVERY, grace)
        left = deadline - time.monotonic()
        reasks = Reasks(min(self.group.reask_after, left / 2)
                        if self.group.reask_after and reask else 0,
                        time.monotonic())
        attached = True
        while not reply.found:
            now = time.monotonic()
            if now >= deadline:
                return None
            try:
                if not attached:
                    reply.attach(link[0], accept)
                    attached = True
                if reasks.due(now):
                    LOG.info('No answer of the image worker for node '
                             '%(node)s yet: sending the command again',
                             {'node': node_uuid})
                    reask()
                try:
                    link[0].drain_events(timeout=min(_TICK, deadline - now))
                except socket.timeout:
                    pass
                link[0].heartbeat_check()
                if reply.found or time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + min(_CONSUMER_CHECK_EVERY,
                                                    grace)
                if self.consumers(link[0]) != 0:
                    idle_since = None
                    continue
                idle_since = idle_since or now
                if now - idle_since >= grace:
                    raise exception.ImageWorkerNotConsuming(
                        node=node_uuid, host=self.host, queue=self.queue,
                        grace=grace, sent=True)
            except _BROKER_ERRORS as e:
                link[0] = self._reconnect(link[0], node_uuid, deadline, e)
                attached = False
        return reply.found[0]

    def call(self, action, node_uuid, instance_info=None, options=None,
             timeout=None, expire=False, extra=None):
        """Send a command and wait for its completion event.

        :param action: ``prepare``, ``deployed`` or ``cleanup``.
        :param node_uuid: the node's UUID.
        :param instance_info: the command's ``instance_info`` (prepare).
        :param options: the command's ``options`` (force_raw, stream_raw).
        :param timeout: seconds to wait for the answer; None waits not at
            all and returns None once the broker has the command.
        :param expire: a command useless later (prepare): the broker drops
            (dead-letters) it when no worker took it within ``timeout``,
            and it is not sent at all when the worker queue has had no
            consumer for [image_worker]worker_restart_grace.
        :param extra: further top-level keys of the command.
        :returns: the completion event (a dict), whatever its status.
        :raises: ImageWorkerBrokerUnreachable, ImageWorkerNotListening,
            ImageWorkerNotConsuming, ImageWorkerTimeout; their ``sent``
            tells whether the worker may still act on the command.
        """
        body = dict(extra or {}, action=action, node_uuid=node_uuid,
                    request_id=uuidutils.generate_uuid())
        if instance_info is not None:
            body['instance_info'] = instance_info
        if options:
            body['options'] = options
        routing_key = '%s.node.%s' % (self.host, action)
        correlation_id = body['request_id']
        # When it was issued: the worker refuses a prepare older than a
        # later cleanup of the node (stale_request).
        properties = {'content_type': 'application/json',
                      'delivery_mode': 2,
                      'correlation_id': correlation_id,
                      'application_headers': {
                          'timestamp_in_ms': int(time.time() * 1000)}}
        policy = self._seal_policy(node_uuid)
        link = [self._connect(node_uuid)]
        reply = None
        sent = False

        def accept(message):
            return _answer_in(message, action, node_uuid, correlation_id,
                              policy=policy)

        try:
            if expire and timeout is not None:
                self._await_consumer(link[0], node_uuid, limit=timeout)
            if timeout is not None:
                reply = _Reply(correlation_id, self.group.reply_queue_type,
                               timeout)
                reply.attach(link[0], accept)
                properties['reply_to'] = reply.name
                if expire:
                    properties['expiration'] = str(int(timeout * 1000))
            LOG.debug('Sending %(action)s for node %(node)s to the image '
                      'worker (%(exchange)s, %(key)s, request %(req)s)',
                      {'action': action, 'node': node_uuid,
                       'exchange': self.group.exchange, 'key': routing_key,
                       'req': correlation_id})
            if not self._publish(link[0].channel(), body, properties,
                                 routing_key, policy, timeout):
                raise exception.ImageWorkerNotListening(
                    node=node_uuid, host=self.host,
                    exchange=self.group.exchange, routing_key=routing_key)
            sent = True
            if timeout is None:
                return None
            deadline = time.monotonic() + timeout

            def reask():
                # Sealed anew: the worker refuses a seal it took before.
                left = max(deadline - time.monotonic(), 1)
                again = dict(properties, application_headers=dict(
                    properties['application_headers']))
                if expire:
                    again['expiration'] = str(int(left * 1000))
                self._publish(link[0].channel(), body, again, routing_key,
                              policy, left)

            event = self._wait(link, reply, accept, deadline, node_uuid,
                               reask)
            if event is None:
                raise exception.ImageWorkerTimeout(
                    node=node_uuid, host=self.host, action=action,
                    timeout=timeout, sent=True)
            LOG.debug('Image worker answered %(action)s for node %(node)s: '
                      '%(status)s', {'action': action, 'node': node_uuid,
                                     'status': event.get('status')})
            return event
        except exception.ImageWorkerError:
            raise
        except _BROKER_ERRORS as e:
            raise exception.ImageWorkerBrokerUnreachable(
                node=node_uuid, reason=str(e), sent=sent)
        finally:
            if reply is not None:
                reply.delete(link[0])
            _release(link[0])

    def send(self, action, node_uuid, timeout, instance_info=None,
             options=None, extra=None, request_id=None, issued_ms=None):
        """Send a command whose answer is collected later (``collect``).

        The answer waits in a reply queue named after the request, which
        expires ``timeout`` (plus a minute) after its last use; the command
        expires in the broker after ``timeout``. Nothing here waits for the
        worker's work.

        :param request_id: the id of a command sent before, to ask for its
            answer again (with ``issued_ms``, when it was first issued).
        :returns: the request id, to collect the answer with.
        :raises: ImageWorkerBrokerUnreachable, ImageWorkerNotListening,
            ImageWorkerNotConsuming (none of them sent).
        """
        request_id = request_id or uuidutils.generate_uuid()
        issued_ms = issued_ms or int(time.time() * 1000)
        body = dict(extra or {}, action=action, node_uuid=node_uuid,
                    request_id=request_id)
        if instance_info is not None:
            body['instance_info'] = instance_info
        if options:
            body['options'] = options
        reply = _Reply(request_id, self.group.reply_queue_type, timeout)
        properties = {'content_type': 'application/json',
                      'delivery_mode': 2,
                      'correlation_id': request_id,
                      'reply_to': reply.name,
                      'expiration': str(int(timeout * 1000)),
                      'application_headers': {
                          'timestamp_in_ms': issued_ms}}
        routing_key = '%s.node.%s' % (self.host, action)
        policy = self._seal_policy(node_uuid)
        connection = self._connect(node_uuid)
        try:
            self._await_consumer(connection, node_uuid, limit=timeout)
            reply.declare(connection)
            if not self._publish(connection.channel(), body, properties,
                                 routing_key, policy, timeout):
                raise exception.ImageWorkerNotListening(
                    node=node_uuid, host=self.host,
                    exchange=self.group.exchange, routing_key=routing_key)
            return request_id
        except exception.ImageWorkerError:
            raise
        except _BROKER_ERRORS as e:
            raise exception.ImageWorkerBrokerUnreachable(
                node=node_uuid, reason=str(e))
        finally:
            _release(connection)

    def collect(self, request_id, node_uuid, source_url=None,
                action='prepare'):
        """The answer of a command ``send`` sent, once it is there.

        Messages of the reply queue that are not the answer
        (``answer.is_answer``) are taken off it and dropped.

        :param source_url: the source, when the worker passes it through
            (``deploy.passed_through``): then the only ``image_url`` a
            successful prepare may answer.
        :returns: the completion (a dict), or None while there is none (the
            reply queue is empty, or gone after its expiry).
        :raises: ImageWorkerBrokerUnreachable
        """
        name = _Reply(request_id, self.group.reply_queue_type, 0).name
        policy = self._seal_policy(node_uuid)
        connection = self._connect(node_uuid)
        try:
            channel = connection.channel()
            while True:
                try:
                    message = channel.basic_get(queue=name, no_ack=True)
                except amqp.exceptions.NotFound:
                    return None
                if message is None:
                    return None
                done = _answer_in(message, action, node_uuid, request_id,
                                  source_url, policy=policy)
                if done is not None:
                    break
            _release(channel)
            _Reply(request_id, self.group.reply_queue_type, 0).delete(
                connection)
            return done
        except _BROKER_ERRORS as e:
            raise exception.ImageWorkerBrokerUnreachable(
                node=node_uuid, reason=str(e), sent=True)
        finally:
            _release(connection)


def _answer_in(message, action, node_uuid, request_id, source_url=None,
               policy=None):
    """The completion ``message`` carries when it is the answer to request
    ``request_id`` (its ``correlation_id``, its seal under ``policy``: made
    for this request's reply queue and correlation id with a known key,
    then ``answer.is_answer``), else None (logged)."""
    correlation_id = message.properties.get('correlation_id')
    if correlation_id != request_id:
        LOG.warning('Ignoring a message on the reply queue of %(action)s '
                    'request %(req)s of node %(node)s: its correlation_id '
                    'is %(got)r; still waiting for the answer',
                    {'action': action, 'req': request_id, 'node': node_uuid,
                     'got': str(correlation_id)[:120]})
        return None
    if policy is not None:
        headers = message.properties.get('application_headers') or {}
        body = message.body
        if isinstance(body, str):
            body = body.encode('utf-8')
        why = policy.refusal(headers.get(seal.HEADER),
                             _Reply(request_id, None, 0).name,
                             request_id, body)
        if why is not None:
            LOG.warning('Ignoring a message on the reply queue of '
                        '%(action)s request %(req)s of node %(node)s: '
                        '%(why)s (not sealed by the worker for this '
                        'request with a key of [image_worker]'
                        'seal_secret_file); still waiting for the answer',
                        {'action': action, 'req': request_id,
                         'node': node_uuid, 'why': why})
            return None
    try:
        done = json.loads(message.body)
    except ValueError:
        done = None
    if answer.is_answer(done, action, node_uuid, request_id, source_url):
        return done
    return None


def _release(resource):
    """Close a connection or channel, ignoring failures (it may be dead)."""
    try:
        if hasattr(resource, 'release'):
            resource.release()
        else:
            resource.close()
    except Exception:  # noqa: nothing more to do with it
        LOG.debug('Closing %r failed', resource, exc_info=True)
