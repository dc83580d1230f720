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

"""Downloads an image with ironic-python-agent's own code.

Usage: python -m ironic_image_worker_deploy.tests.ipa_download INFO DIR

INFO is a JSON file holding the ``image_info`` Ironic's ``write_image``
deploy step sends to the agent; the image is written to DIR/<id> and
verified by the agent's code (``os_hash_value`` or ``checksum``).
"""

import json
import sys
import tempfile

from oslo_config import cfg


def main():
    info_path, workdir = sys.argv[1], sys.argv[2]
    from ironic_python_agent import config
    config.populate_config()
    cfg.CONF([], project='ironic-python-agent', default_config_files=[])
    cfg.CONF.set_override('image_download_connection_retries', 0)
    from ironic_python_agent.extensions import standby
    with open(info_path) as f:
        image_info = json.load(f)
    tempfile.tempdir = workdir
    standby._validate_image_info(None, image_info)
    standby._download_image(image_info)
    print('downloaded and verified', image_info['id'])


if __name__ == '__main__':
    main()
