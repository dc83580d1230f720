"""What the VM deploys' machines and processes print, read the same way
by the VMs the harness starts (tests/vm/deploy.py), the libvirt domains
Ironic powers on and sushy-tools (tests/vm/redfish.py): each writes to a
file."""

import subprocess


class SerialConsole(object):
    """What the machine printed on its serial port, read from the file
    ``self.console``."""

    console = None

    def console_text(self):
        try:
            with open(self.console, 'rb') as f:
                return f.read().decode(errors='replace')
        except OSError:
            return ''

    def tail(self, n=40):
        """The last ``n`` lines, for a failure's message."""
        return '\n'.join(self.console_text().splitlines()[-n:])


class LoggedProcess(object):
    """A process of the harness (the worker, sushy-tools) writing its
    output to the file ``self.log_path``, opened as ``self.log``;
    ``self.proc`` once started."""

    proc = None
    log = None
    log_path = None

    def tail(self, n=30):
        """The log's last ``n`` lines, for a failure's message."""
        with open(self.log_path, 'rb') as f:
            return b'\n'.join(f.read().splitlines()[-n:]).decode(
                errors='replace')

    def stop(self):
        """SIGTERM, then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
