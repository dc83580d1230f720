"""Calls the worker's JSON-RPC listener with Ironic's own client
(``ironic.common.json_rpc.client``), configured in a group of its own as
Ironic configures ``[json_rpc]`` (``ironic.conf.json_rpc.register_opts``).

Usage: json_rpc_call.py PORT [--user U --password P] [--cafile F]
Reads one call a line on stdin: {"method": ..., "cast": bool, "params": {...}}
and prints one line each: {"result": ...} or {"error": {"class": ...,
"message": ..., "status": ...}}.
"""

import argparse
import json
import os
import sys
import tempfile

from oslo_config import cfg

from ironic.common import context as ironic_context
from ironic.common.json_rpc import client
from ironic.conf import json_rpc as json_rpc_conf
from ironic.objects import base as objects_base

GROUP = 'iiw_test_json_rpc'


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('port', type=int)
    parser.add_argument('--user')
    parser.add_argument('--password')
    parser.add_argument('--cafile')
    args = parser.parse_args()
    # Written as an operator writes ironic.conf: keystoneauth registers
    # the http_basic plugin's options (username, password) when it loads
    # the plugin from the file.
    lines = ['[%s]' % GROUP, 'port = %d' % args.port, 'timeout = 30']
    if args.user is not None:
        lines += ['auth_strategy = http_basic', 'auth_type = http_basic',
                  'username = %s' % args.user,
                  'password = %s' % args.password]
    else:
        lines += ['auth_strategy = noauth']
    if args.cafile:
        lines += ['use_ssl = true', 'cafile = %s' % args.cafile]
    with tempfile.NamedTemporaryFile('w', suffix='.conf',
                                     delete=False) as f:
        f.write('\n'.join(lines) + '\n')
    conf = cfg.CONF
    json_rpc_conf.register_opts(conf, group=GROUP)
    conf(['--config-file', f.name], project='ironic')
    os.unlink(f.name)
    rpc = client.Client(objects_base.IronicObjectSerializer(),
                        conf_group=GROUP)
    cctxt = rpc.prepare(topic='ironic.127.0.0.1:%d' % args.port,
                        version='1.0')
    ctx = ironic_context.get_admin_context()
    for line in sys.stdin:
        if not line.strip():
            continue
        call = json.loads(line)
        send = cctxt.cast if call.get('cast') else cctxt.call
        try:
            out = {'result': send(ctx, call['method'], **call['params'])}
        except Exception as e:  # noqa: reported to the test
            out = {'error': {
                'class': '%s.%s' % (type(e).__module__, type(e).__name__),
                'message': str(e),
                'status': getattr(e, 'http_status', None)
                or getattr(e, 'code', None)}}
        print(json.dumps(out), flush=True)


if __name__ == '__main__':
    main()
