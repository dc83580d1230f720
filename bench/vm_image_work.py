"""Stock ``direct``'s work on one image for N nodes, done on its own by
Ironic's own code, so that bench/vm can take it off stock's CPU: for each
node, what Ironic's ``_cache_and_convert_image`` does to the image with
``image_download_source = local`` and ``force_raw_images``: ``fetch_images``
into its ``InstanceImageCache`` (the first node downloads the source with
Ironic's HTTP image service, verifies its sha256, inspects it and converts it
to raw with ``qemu-img``; the others find the master and link it), then the
sha256 of the node's raw image, computed again for each node.

Prints one JSON object: the wall and CPU seconds of that work (this
process's and its children's: ``qemu-img``), Python's start and Ironic's
imports left out.

Usage: python bench/vm_image_work.py URL SHA256 WORKDIR NODES
(run with the Ironic virtualenv's Python; WORKDIR is left with the files).
"""

import json
import os
import resource
import sys
import time

from ironic.common import checksum_utils
from ironic.common import context
from ironic.conf import CONF
from ironic.drivers.modules import deploy_utils

QCOW2_MAGIC = b'QFI\xfb'


def cpu():
    """CPU seconds of this process and its reaped children."""
    return sum(r.ru_utime + r.ru_stime for r in (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN)))


def main(url, checksum, workdir, nodes):
    CONF([], project='ironic', default_config_files=[])
    CONF.set_override('force_raw_images', True)
    CONF.set_override('stream_raw_images', True, 'agent')
    CONF.set_override('instance_master_path',
                      os.path.join(workdir, 'master_images'), 'pxe')
    CONF.set_override('images_path', os.path.join(workdir, 'images'), 'pxe')
    ctx = context.get_admin_context()
    started, spent = time.monotonic(), cpu()
    for n in range(nodes):
        disk = os.path.join(workdir, 'images', 'node-%d' % n, 'disk')
        os.makedirs(os.path.dirname(disk))
        deploy_utils.fetch_images(
            ctx, deploy_utils.InstanceImageCache(), [(url, disk)],
            force_raw=True, expected_format='qcow2',
            expected_checksum=checksum, expected_checksum_algo='sha256')
        with open(disk, 'rb') as f:
            if f.read(4) == QCOW2_MAGIC:
                raise AssertionError('Ironic cached the qcow2, not raw')
        checksum_utils.compute_image_checksum(disk, 'sha256')
    print(json.dumps({'wall': time.monotonic() - started,
                      'cpu': cpu() - spent}))


if __name__ == '__main__':
    url, checksum, workdir, nodes = sys.argv[1:]
    main(url, checksum, workdir, int(nodes))
