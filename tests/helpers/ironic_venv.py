"""Make (once) the Ironic virtualenv the tests run Ironic's own code in.

Usage: ironic_venv.py VENV

The pins are the deploy interface's test-requirements.txt plus the
repository's own test tools (EXTRA below). A virtualenv made for exactly
these pins says so in VENV/.ironic-image-worker-pins and is left as it is
(importing Ironic to find out would cost seconds of CPU at every call);
otherwise pip installs the pins from PyPI (into a new virtualenv if there is
none) and what the tests import is checked. Concurrent callers (test
processes, `.ci/run` making it ahead of the build) wait for each other on a
lock beside VENV.
Prints VENV's python; exits non-zero with pip's error when it cannot be made.
"""
import fcntl
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIREMENTS = os.path.join(REPO, "ironic-plugin", "test-requirements.txt")
# Beside the plug-in's pins, for this repository's own tests: pushes OCI
# artifacts as operators do (tests/it/oci.rs).
EXTRA = ["oras==0.2.43"]
# What a ready virtualenv imports.
IMPORTS = ("import ironic.conductor.notification_utils, ironic_python_agent, "
           "pytest, fixtures, oslotest, oras.client")
MARKER = ".ironic-image-worker-pins"


def pins():
    with open(REQUIREMENTS) as f:
        lines = [line.strip() for line in f]
    return [p for p in lines if p and not p.startswith("#")] + EXTRA


def run(cmd):
    # pip talks on stdout, which carries the answer.
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def make(venv, wanted):
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        run([sys.executable, "-m", "venv", venv])
    pip = [os.path.join(venv, "bin", "pip"), "install", "-q",
           "--disable-pip-version-check"]
    ironic = [p for p in wanted if p.startswith("ironic==")]
    others = [p for p in wanted if not p.startswith("ironic==")]
    # Ironic first, as an operator installs it; then the test tools. In a
    # virtualenv made for other pins, pip moves what changed.
    run(pip + ironic)
    run(pip + others)
    run([python, "-c", IMPORTS])


def main():
    venv = os.path.abspath(sys.argv[1])
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    wanted = pins()
    marker = os.path.join(venv, MARKER)
    with open(os.path.join(os.path.dirname(venv), "ironic-venv.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(marker) as f:
                made = f.read()
        except OSError:
            made = None
        if made != "\n".join(wanted):
            make(venv, wanted)
            with open(marker, "w") as f:
                f.write("\n".join(wanted))
    print(os.path.join(venv, "bin", "python"))


if __name__ == "__main__":
    main()
