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

"""Commands to ironic-image-worker through Ironic's own JSON-RPC client.

For an Ironic without a broker (``[image_worker]transport = json-rpc``):
the worker's ``[json_rpc]`` listener is called with
``ironic.common.json_rpc.client.Client`` configured by the
``[image_worker_json_rpc]`` group, as Ironic calls ironic-networking. The
same three methods as the AMQP client: ``send`` (a cast: queued, not
waited for), ``collect`` (the answer once there) and ``call`` (send and
wait).
"""

import re
import time

from keystoneauth1 import exceptions as ks_exc
from oslo_config import cfg
from oslo_log import log
from oslo_utils import netutils
from oslo_utils import uuidutils

from ironic.common import context as ironic_context
from ironic.common import exception as ironic_exc
from ironic.common.json_rpc import client as json_rpc
from ironic.objects import base as objects_base

from ironic_image_worker_deploy import answer
from ironic_image_worker_deploy import conf as worker_conf
from ironic_image_worker_deploy import exception

LOG = log.getLogger(__name__)

CONF = cfg.CONF

# The worker's errors: "<error_code>: <message>" (docs/contract.md).
_CODED = re.compile(r'^([a-z_]+): (.*)$', re.S)

# How long a call waits between two looks at a command in progress.
_STATUS_EVERY = 1.0


class JsonRpcWorkerClient(object):
    """Sends commands to the worker named by [image_worker_json_rpc]."""

    def __init__(self, conf=CONF, context=None):
        self.conf = conf
        self.group = conf[worker_conf.JSON_RPC_GROUP]
        self.context = context or ironic_context.get_admin_context()

    @property
    def url(self):
        scheme = 'https' if (self.group.use_ssl
                             or self.group.client_use_ssl) else 'http'
        return '%s://%s:%d' % (scheme,
                               netutils.escape_ipv6(self.group.host_ip),
                               self.group.port)

    def _cctxt(self):
        client = json_rpc.Client(objects_base.IronicObjectSerializer(),
                                 version_cap='1.0',
                                 conf_group=worker_conf.JSON_RPC_GROUP)
        topic = 'ironic.%s:%d' % (netutils.escape_ipv6(self.group.host_ip),
                                  self.group.port)
        return client.prepare(topic=topic, version='1.0')

    def _invoke(self, cast, method, node_uuid, params, sent=False,
                action=None):
        """One request; the worker's failures as ImageWorker errors.

        A completion error comes back as the Ironic exception the client
        raises, its message starting with the worker's error code: the
        failed completion of ``action`` (default: ``method``).
        """
        cctxt = self._cctxt()
        send = cctxt.cast if cast else cctxt.call
        try:
            return send(self.context, method, **params)
        except ks_exc.Unauthorized as e:
            raise exception.ImageWorkerUnauthorized(
                node=node_uuid, url=self.url, reason=str(e), sent=sent)
        except (ks_exc.ConnectFailure, ks_exc.ConnectTimeout,
                ks_exc.SSLError, ks_exc.RetriableConnectionFailure) as e:
            raise exception.ImageWorkerUnreachable(
                node=node_uuid, url=self.url, reason=str(e), sent=sent)
        except ks_exc.ClientException as e:
            raise exception.ImageWorkerError(
                node=node_uuid, host=self.url, error_code='internal',
                reason=str(e), sent=sent)
        except ironic_exc.IronicException as e:
            return _failed_completion(e, action or method, node_uuid,
                                      params)

    def send(self, action, node_uuid, timeout=None, instance_info=None,
             options=None, extra=None, request_id=None, issued_ms=None):
        """Queue a command on the worker (a cast); returns its request id.
        (``issued_ms``, the broker's issue-time header, has no place in a
        JSON-RPC call: the worker counts from the call.)

        :raises: ImageWorkerUnreachable, ImageWorkerUnauthorized (not sent).
        """
        params = self._params(action, node_uuid, instance_info, options,
                              extra, request_id)
        self._invoke(True, action, node_uuid, params)
        return params['request_id']

    def collect(self, request_id, node_uuid, source_url=None,
                action='prepare'):
        """The answer of ``request_id`` once the worker has it, else None.

        A worker that no longer knows the request (it restarted since)
        answers it as an error (``no_worker``). A result that is not the
        answer to the request (``answer.is_answer``; ``source_url`` as for
        the AMQP client's ``collect``) counts as none yet.
        """
        known = self._invoke(False, 'status', node_uuid,
                             {'node_uuid': node_uuid,
                              'request_id': request_id}, sent=True,
                             action=action)
        if known.get('status') in ('success', 'error'):
            if answer.is_answer(known, action, node_uuid, request_id,
                                source_url):
                return known
            return None
        if known.get('status') == 'unknown':
            # Queued before the cast returned, so the worker has lost it
            # (restarted): the deploy fails now, not at its deadline.
            return {'action': action, 'status': 'error',
                    'node_uuid': node_uuid, 'request_id': request_id,
                    'error': {'code': 'no_worker', 'message': (
                        'the image worker at %s has no record of request '
                        '%s (it restarted meanwhile?); deploy again'
                        % (self.url, request_id))}}
        return None

    def call(self, action, node_uuid, instance_info=None, options=None,
             timeout=None, expire=False, extra=None):
        """Send a command and wait up to ``timeout`` for its completion
        (``None``: send it as a cast and return None)."""
        if timeout is None:
            self.send(action, node_uuid, instance_info=instance_info,
                      options=options, extra=extra)
            return None
        params = self._params(action, node_uuid, instance_info, options,
                              extra, None)
        deadline = time.monotonic() + timeout
        request_id = params['request_id']
        done = self._invoke(False, action, node_uuid, params)
        if (done.get('status') not in ('success', 'error')
                or not answer.is_answer(done, action, node_uuid,
                                        request_id)):
            done = None
        while done is None:
            if time.monotonic() >= deadline:
                raise exception.ImageWorkerTimeout(
                    node=node_uuid, host=self.url, action=action,
                    timeout=timeout, sent=True)
            time.sleep(min(_STATUS_EVERY, max(0, deadline - time.monotonic())))
            done = self.collect(request_id, node_uuid, action=action)
        return done

    @staticmethod
    def _params(action, node_uuid, instance_info, options, extra,
                request_id):
        params = dict(extra or {}, node_uuid=node_uuid,
                      request_id=request_id or uuidutils.generate_uuid())
        if instance_info is not None:
            params['instance_info'] = instance_info
        if options:
            params['options'] = options
        return params


def _failed_completion(error, method, node_uuid, params):
    """The completion a worker's error stands for (its code from the
    message; ``internal`` when the message has none)."""
    found = _CODED.match(str(error))
    code, message = found.groups() if found else ('internal', str(error))
    return {'action': method, 'status': 'error', 'node_uuid': node_uuid,
            'request_id': params.get('request_id'),
            'error': {'code': code, 'message': message}}
