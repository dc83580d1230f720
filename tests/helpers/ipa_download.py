"""Downloads and verifies one image with ironic-python-agent's own code.

Usage: ipa_download.py IMAGE_INFO.json WORKDIR CAFILE TLS_MIN_VERSION

IMAGE_INFO is what Ironic sends the agent (id, urls, checksums and, with
[deploy]image_server_auth_strategy = http_basic, image_server_auth_strategy /
image_server_user / image_server_password). The agent's own
requests session verifies the server against CAFILE and enforces
TLS_MIN_VERSION, as on a node. Prints "downloaded and verified <id> in <s> s"
(the time of the agent's download-and-verify call, imports apart) or exits
non-zero with the agent's error on stderr.
"""

import json
import sys
import tempfile
import time

from oslo_config import cfg


def main():
    info_path, workdir, cafile, tls_min = sys.argv[1:5]
    from ironic_python_agent import config
    config.populate_config()
    cfg.CONF([], project='ironic-python-agent', default_config_files=[])
    cfg.CONF.set_override('image_download_connection_retries', 0)
    cfg.CONF.set_override('cafile', cafile)
    cfg.CONF.set_override('tls_min_version', tls_min)
    from ironic_python_agent.extensions import standby
    with open(info_path) as f:
        image_info = json.load(f)
    tempfile.tempdir = workdir
    standby._validate_image_info(None, image_info)
    started = time.monotonic()
    standby._download_image(image_info)
    took = time.monotonic() - started
    print('downloaded and verified', image_info['id'], f'in {took:.3f} s')


if __name__ == '__main__':
    main()
