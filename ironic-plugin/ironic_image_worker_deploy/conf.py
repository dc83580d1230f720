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

"""Options of the ``[image_worker]`` section of ironic.conf, and the
``[image_worker_json_rpc]`` group: Ironic's own JSON-RPC client options
(``host_ip``, ``port``, ``auth_strategy``, keystoneauth's ``auth_type``,
``username``, ``password``, ``use_ssl``, ``cafile``, ``insecure``,
``timeout``), registered by Ironic's own ``ironic.conf.json_rpc``, as Ironic
registers ``[json_rpc]`` and ``[ironic_networking_json_rpc]``."""

import copy

from oslo_config import cfg

from ironic.common.i18n import _
from ironic.conf import json_rpc as ironic_json_rpc

CONF = cfg.CONF

GROUP = 'image_worker'

JSON_RPC_GROUP = 'image_worker_json_rpc'

# The worker's JSON-RPC port by default: not Ironic's own 8089, so that
# both can run on one host.
JSON_RPC_PORT = 8099

# Where [image_worker_json_rpc] differs from Ironic's [json_rpc]: the
# worker's port, and where the worker is (a sidecar beside the conductor
# by default), not where a server binds.
JSON_RPC_DEFAULTS = {'port': JSON_RPC_PORT, 'host_ip': '127.0.0.1'}

opts = [
    cfg.StrOpt('transport',
               default='amqp',
               choices=[('amqp', _('commands over RabbitMQ (the broker of '
                                   '[image_worker]transport_url or '
                                   '[DEFAULT]transport_url)')),
                        ('json-rpc', _('commands through Ironic\'s JSON-RPC '
                                       'client to the worker\'s [json_rpc] '
                                       'listener, configured in '
                                       '[image_worker_json_rpc]: for an '
                                       'Ironic without a broker'))],
               help=_('How the deploy interface reaches the worker.')),
    cfg.BoolOpt('image_server_auth',
                default=False,
                help=_('Whether the worker\'s image port requires HTTP '
                       'Basic (its [http]auth_strategy = http_basic). The '
                       'agent is then handed [deploy]image_server_user and '
                       'image_server_password for the worker\'s URL, as '
                       'Ironic hands them for its own: validate refuses a '
                       'node unless [deploy]image_server_auth_strategy is '
                       'http_basic with both set, and the host of '
                       '[deploy]http_url is permitted by '
                       '[deploy]image_server_auth_hosts.')),
    cfg.FloatOpt('poll_interval',
                 default=2.0,
                 min=0.2,
                 help=_('Seconds between two looks at a prepare under way '
                        'while the node boots its ramdisk (how soon a '
                        'failure fails the deploy, and how soon a deploy '
                        'waiting for its image goes on).')),
    cfg.StrOpt('exchange',
               default='ironic-image-worker',
               help=_('Topic exchange on which ironic-image-worker takes '
                      'its commands. Must match the worker\'s '
                      '[amqp]command_exchange.')),
    cfg.StrOpt('queue_prefix',
               default='ironic-image-worker',
               help=_('Prefix of the worker\'s command queue, which is '
                      'named <queue_prefix>.<conductor_host>. Must match '
                      'the worker\'s [amqp]queue_prefix. Its consumer '
                      'count tells whether a worker is running.')),
    cfg.StrOpt('conductor_host',
               help=_('[DEFAULT]host of the worker that serves this '
                      'conductor. Commands are routed to '
                      '<conductor_host>.node.<action>. Defaults to this '
                      'conductor\'s own [DEFAULT]host, which is what the '
                      'worker on the same machine uses.')),
    cfg.StrOpt('transport_url',
               secret=True,
               help=_('Broker of the worker, in the form of '
                      '[DEFAULT]transport_url (several hosts may be given, '
                      'separated by commas). Defaults to '
                      '[DEFAULT]transport_url. TLS follows the '
                      '[oslo_messaging_rabbit] ssl* options.')),
    cfg.IntOpt('prepare_timeout',
               default=1800,
               min=1,
               help=_('Seconds to wait for the worker to answer a prepare '
                      'command (download, verification, conversion and '
                      'hashing of the instance image). The command expires '
                      'in the broker after this time too, so a worker that '
                      'comes back later does not act on it.')),
    cfg.IntOpt('command_timeout',
               default=30,
               min=0,
               help=_('Seconds to wait for the worker to confirm a '
                      'deployed or cleanup command. A missing or failed '
                      'confirmation is logged and never fails the '
                      'operation; 0 sends without waiting.')),
    cfg.IntOpt('reask_after',
               default=30,
               min=0,
               help=_('Seconds without the worker\'s answer after which a '
                      'command is sent again with the same request id, '
                      'then again after twice as long each time (at most '
                      'every 5 minutes), until its timeout: an answer lost '
                      'with a broker node then costs seconds, not the '
                      'deploy. The worker answers a command it already '
                      'answered again, or works it again idempotently (a '
                      'cache hit). A deployed or cleanup, waited for '
                      '[image_worker]command_timeout, is asked again after '
                      'half of it at the latest. 0 never asks again.')),
    cfg.IntOpt('worker_restart_grace',
               default=30,
               min=0,
               help=_('Seconds the worker\'s command queue may have no '
                      'consumer (a worker restarting) before a command '
                      'fails with error_code no_worker instead of waiting '
                      'for its whole timeout: a prepare is then not sent '
                      'at all, and a wait ends early when the worker stops '
                      'during it.')),
    cfg.StrOpt('reply_queue_type',
               default='quorum',
               choices=[('quorum', _('replicated across a RabbitMQ '
                                     'cluster: an answer survives the '
                                     'loss of a broker node')),
                        ('classic', _('for brokers without quorum '
                                      'queues; an answer survives a '
                                      'reconnection, not the loss of '
                                      'the node holding the queue'))],
               help=_('Type of the reply queue declared for each command '
                      'waited for. It is named after the request, durable '
                      'and expires (x-expires) after the wait, so that '
                      'the interface reconnects and waits on for the '
                      'answer when its broker connection fails.')),
    cfg.ListOpt('extend_hardware_types',
                default=[],
                help=_('In-tree hardware types (names as in '
                       '[DEFAULT]enabled_hardware_types, e.g. redfish, '
                       'ipmi, idrac) made to accept the direct-worker '
                       'deploy interface, listed right after direct, when '
                       'Ironic loads the interface. For deployments that '
                       'cannot choose a node\'s hardware type (Metal3\'s '
                       'baremetal-operator derives it from the BMC '
                       'address); otherwise use the hardware types of '
                       'this package (ipmi-worker, redfish-worker, '
                       'idrac-worker, intel-ipmi-worker, '
                       'manual-management-worker), which leave Ironic\'s '
                       'own types as they are. A name that is not a '
                       'hardware type fails the interface\'s loading.')),
    cfg.StrOpt('seal_secret_file',
               help=_('File of the keys that seal the commands sent to the '
                      'worker over the broker and the worker\'s answers '
                      '(the same file as the worker\'s '
                      '[amqp]seal_secret_file): one hex key a line, at '
                      'least 32 random bytes (64 hex digits), the current '
                      'key first and an optional previous one second while '
                      'a new key goes round. Mode 0600 or 0640. Read for '
                      'every command, so a new key takes effect without a '
                      'restart. Unset: nothing is sealed.')),
    cfg.StrOpt('seal',
               choices=[('off', _('nothing sealed, no seal checked')),
                        ('send', _('commands sealed; unsealed answers '
                                   'taken (a rolling upgrade: the worker '
                                   'does not seal yet)')),
                        ('require', _('commands sealed; only answers '
                                      'sealed for the very request with '
                                      'a known key are taken'))],
               help=_('Whether commands are sealed and answers must be. '
                      'Unset: require with seal_secret_file, off without. '
                      'An answer that is not taken is logged and skipped; '
                      'the interface keeps waiting for the worker\'s own. '
                      'Not used by the json-rpc transport (its own HTTP '
                      'Basic and TLS protect it).')),
    cfg.FloatOpt('connect_timeout',
                 default=10.0,
                 min=0.1,
                 help=_('Seconds to wait for a connection to each broker '
                        'host.')),
]


def register_opts(conf):
    """Register the ``[image_worker]`` and ``[image_worker_json_rpc]``
    options on ``conf``."""
    conf.register_opts(opts, group=GROUP)
    ironic_json_rpc.register_opts(conf, group=JSON_RPC_GROUP)
    for name, default in JSON_RPC_DEFAULTS.items():
        conf.set_default(name, default, group=JSON_RPC_GROUP)


def list_opts():
    """Options for oslo-config-generator (``oslo.config.opts``), with the
    defaults in force (the generator reads an option's own default, which
    ``set_default`` leaves alone)."""
    json_rpc = []
    for opt in ironic_json_rpc.list_opts():
        if opt.dest in JSON_RPC_DEFAULTS:
            opt = copy.copy(opt)
            opt.default = JSON_RPC_DEFAULTS[opt.dest]
        json_rpc.append(opt)
    return [(GROUP, opts), (JSON_RPC_GROUP, json_rpc)]


register_opts(CONF)
