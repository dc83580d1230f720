"""Run Ironic's own image-cache code beside the worker.

Ironic 39's InstanceImageCache (ironic.drivers.modules.deploy_utils) and
image_cache.clean_up_all, configured through a generated ironic.conf exactly
as ironic-conductor reads it.

Usage: ironic_image_cache.py
Reads one SPEC_JSON a line on stdin and runs each in turn, as one conductor
configured by the first (its directories):
SPEC_JSON: {"op": "fetch" | "clean",
            "master": Ironic's [pxe]instance_master_path,
            "images": Ironic's [pxe]images_path,
            "allowed": a [conductor]file_url_allowed_paths entry,
            # fetch: InstanceImageCache().fetch_image(href, images/node/disk)
            "node": uuid, "href": url, "force_raw": bool,
            "checksum": hex, "checksum_algo": "md5",
            # clean: clean_up_all() with a zero size and TTL (every unlinked
            # plain file goes), repeated until the file "until" exists
            "until": path}
Prints one JSON line per spec: {"ok": true, ...} or {"ok": false, "error": "..."}.
"""
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

from ironic.common import config as ironic_config  # noqa: E402
from ironic.common import context as ironic_context  # noqa: E402
from ironic.drivers.modules import deploy_utils  # noqa: E402
from ironic.drivers.modules import image_cache  # noqa: E402
from ironic import objects  # noqa: E402


def configure(spec):
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write(
            "[DEFAULT]\n"
            "host = ironic-cache-test\n"
            "force_raw_images = true\n"
            "[pxe]\n"
            f"instance_master_path = {spec['master']}\n"
            f"images_path = {spec['images']}\n"
            "image_cache_size = 0\n"
            "image_cache_ttl = 0\n"
            "[conductor]\n"
            f"file_url_allowed_paths = {spec.get('allowed', '/var/lib/ironic')}\n"
        )
    objects.register_all()
    ironic_config.parse_args(
        ["ironic-conductor", "--config-file", conf.name], default_config_files=[]
    )
    os.unlink(conf.name)


def fetch(spec):
    ctx = ironic_context.get_admin_context()
    node_dir = os.path.join(spec["images"], spec["node"])
    os.makedirs(node_dir, exist_ok=True)
    dest = os.path.join(node_dir, "disk")
    cache = deploy_utils.InstanceImageCache()
    cache.fetch_image(
        spec["href"],
        dest,
        ctx=ctx,
        force_raw=spec.get("force_raw", True),
        expected_checksum=spec.get("checksum"),
        expected_checksum_algo=spec.get("checksum_algo"),
    )
    st = os.stat(dest)
    return {"ino": st.st_ino, "nlink": st.st_nlink, "size": st.st_size}


def clean(spec):
    runs = 0
    errors = []
    while True:
        try:
            image_cache.clean_up_all()
        except Exception as e:  # a failing clean-up is a finding, not a crash
            errors.append(f"{type(e).__name__}: {e}")
        runs += 1
        if not spec.get("until") or os.path.exists(spec["until"]):
            return {"runs": runs, "errors": errors}
        time.sleep(0.01)  # pace the sweeps; not a synchronisation


def run(spec):
    try:
        result = {"fetch": fetch, "clean": clean}[spec["op"]](spec)
        result["ok"] = True
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                  "trace": traceback.format_exc()}
    print(json.dumps(result), flush=True)


def main():
    configured = False
    for line in sys.stdin:
        spec = json.loads(line)
        if not configured:
            configure(spec)
            configured = True
        run(spec)


if __name__ == "__main__":
    main()
