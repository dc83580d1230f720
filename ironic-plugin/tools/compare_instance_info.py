#!/usr/bin/env python3
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

"""Wall time of the instance-info step: direct-worker vs Ironic itself.

Makes a qcow2 of 1 GiB virtual size (512 MiB of random data, zeros after)
served by a local HTTP server, then times, for two fresh nodes:

* Ironic 39's own ``build_instance_info_for_deploy`` in local mode
  (``[agent]image_download_source = local``, force_raw): the conductor
  downloads, checks, converts and hashes into its own cache;
* ``DirectWorkerDeploy._build_instance_info``: a prepare command to a worker
  started from ``--worker-bin`` (its own directories, cold cache), and the
  wait for its completion.

Both fill instance_info for the same image; the script checks they publish
the same checksum and prints both times and their ratio.

    ironic-venv/bin/python ironic-plugin/tools/compare_instance_info.py \\
        --worker-bin target/release/ironic-image-worker
"""

import argparse
import os
import shutil
import tempfile
import time
import types
import uuid

import ironic.tests.unit  # noqa: F401 (oslo.service backend, as the tests)

from ironic.common import config as ironic_config
from ironic.common import context as ironic_context
from ironic.conf import CONF
from ironic.drivers.modules import deploy_utils
from ironic import objects

from ironic_image_worker_deploy import deploy
from ironic_image_worker_deploy.tests import parts


def _node(ctx, source, sha256, deploy_interface):
    return objects.Node(
        ctx, uuid=str(uuid.uuid4()), driver='fake-hardware', properties={},
        deploy_interface=deploy_interface, boot_interface='fake',
        driver_info={}, driver_internal_info={'is_whole_disk_image': True},
        instance_info={'image_source': source,
                       'image_os_hash_algo': 'sha256',
                       'image_os_hash_value': sha256,
                       'image_disk_format': 'qcow2'})


def _worker_config(root, host, http_port, metrics_port):
    path = os.path.join(root, 'worker.toml')
    with open(path, 'w') as f:
        f.write('[DEFAULT]\nhost = "%(host)s"\n'
                '[deploy]\nhttp_root = "%(root)s/httpboot"\n'
                'http_url = "http://127.0.0.1:%(http)d"\n'
                '[pxe]\ninstance_master_path = "%(root)s/master_images"\n'
                'images_path = "%(root)s/images"\n'
                '[http]\nlisten = "127.0.0.1:%(http)d"\n'
                '[metrics]\nlisten = "127.0.0.1:%(metrics)d"\n'
                % {'host': host, 'root': root, 'http': http_port,
                   'metrics': metrics_port})
    return path


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--worker-bin', required=True)
    parser.add_argument('--transport-url',
                        default='rabbit://guest:guest@127.0.0.1:5672/')
    parser.add_argument('--random-mib', type=int, default=512)
    parser.add_argument('--virtual-gib', type=int, default=1)
    parser.add_argument('--dir', help='work directory (default: a new '
                        'temporary directory, removed at the end)')
    args = parser.parse_args()

    work = args.dir or tempfile.mkdtemp(prefix='iiw-compare-')
    src = os.path.join(work, 'src')
    for d in (src, os.path.join(work, 'ironic', 'httpboot'),
              os.path.join(work, 'worker')):
        os.makedirs(d, exist_ok=True)
    raw = os.path.join(work, 'disk.raw')
    with open(raw, 'wb') as f:
        for _ in range(args.random_mib):
            f.write(os.urandom(1 << 20))
        f.truncate(args.virtual_gib << 30)
    img = os.path.join(src, 'disk.qcow2')
    parts.qcow2_from(raw, img)
    os.unlink(raw)
    sha256 = parts.file_hash(img, 'sha256')
    source = parts.SourceServer(src)
    # Ironic checks its own published URL with a HEAD request.
    ironic_http = parts.SourceServer(os.path.join(work, 'ironic',
                                                  'httpboot'))

    host = 'compare-%s' % uuid.uuid4().hex
    http_port, metrics_port = _free_port(), _free_port()
    config = _worker_config(os.path.join(work, 'worker'), host, http_port,
                            metrics_port)
    worker = parts.SpareWorker(args.worker_bin, config, metrics_port)
    worker.start()
    try:
        ironic_config.parse_args([], default_config_files=[])
        CONF.set_override('host', host)
        CONF.set_override('transport_url', args.transport_url)
        CONF.set_override('image_download_source', 'local', group='agent')
        CONF.set_override('http_root', os.path.join(work, 'ironic',
                                                    'httpboot'),
                          group='deploy')
        CONF.set_override('http_url', 'http://127.0.0.1:%d'
                          % ironic_http.port, group='deploy')
        CONF.set_override('instance_master_path',
                          os.path.join(work, 'ironic', 'master_images'),
                          group='pxe')
        CONF.set_override('images_path', os.path.join(work, 'ironic',
                                                      'images'),
                          group='pxe')
        ctx = ironic_context.get_admin_context()
        url = source.url('disk.qcow2')

        os.sync()
        task = types.SimpleNamespace(context=ctx,
                                     node=_node(ctx, url, sha256,
                                                'direct'))
        started = time.monotonic()
        ironic_info = deploy_utils.build_instance_info_for_deploy(task)
        ironic_s = time.monotonic() - started

        os.sync()
        task = types.SimpleNamespace(context=ctx,
                                     node=_node(ctx, url, sha256,
                                                'direct-worker'))
        started = time.monotonic()
        worker_info = deploy.DirectWorkerDeploy()._build_instance_info(task)
        worker_s = time.monotonic() - started
    finally:
        worker.stop()
        source.stop()
        ironic_http.stop()
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    same = (ironic_info['image_os_hash_value']
            == worker_info['image_os_hash_value'])
    print('image: %d GiB virtual qcow2, %d MiB random data'
          % (args.virtual_gib, args.random_mib))
    print('ironic build_instance_info_for_deploy (local, force_raw): '
          '%.2f s' % ironic_s)
    print('direct-worker instance-info step: %.2f s' % worker_s)
    print('ratio direct-worker / ironic: %.2f' % (worker_s / ironic_s))
    print('same sha256 published: %s' % same)
    if not same:
        raise SystemExit(1)


if __name__ == '__main__':
    main()
