"""The serial console of a VM deploy's machine, shared by the VMs the
harness starts (tests/vm/deploy.py) and the libvirt domains Ironic powers
on (tests/vm/redfish.py): both write it to a file."""


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
