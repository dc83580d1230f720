"""The Metal3 way of booting the VM deploys' machines (tests/vm/deploy.py
``--boot redfish``): the node is on Ironic's ``redfish`` hardware type
(redfish power and management, ``redfish-virtual-media`` boot), its BMC is
sushy-tools' emulator with its libvirt driver, and the machine is a libvirt
domain that Ironic powers on itself, booting the ISO it builds from the
ramdisk's kernel and initramfs (as Metal3's Ironic does for a
``redfish-virtualmedia://`` BMC address).

What it needs (``.ci/run`` provides it): libvirtd (and virtlogd) running
with, in /etc/libvirt/qemu.conf, ``seccomp_sandbox = 0`` (QEMU's sandbox
would deny the processes of the guest's forwards) and QEMU run as root
(``user = "+0"``, ``group = "+0"``: libvirt probes QEMU as root but checks
its cached probe as the QEMU user, and where only root may open /dev/kvm
it probes again on every call, 8 s or more each); ``virsh``;
sushy-tools in the virtualenv tests/vm/sushy-venv makes; SeaBIOS; and for
Ironic's BIOS ISO ``isolinux.bin``, ``ldlinux.c32`` and ``mkisofs``.

The domain has no libvirt network: its NIC is QEMU's user network given
on QEMU's command line, exactly as deploy.py's ``Vm`` has it (``restrict=on``,
a ``hostfwd`` to the agent, ``guestfwd`` rules to the host's ports), on a
fixed PCI slot, with the MAC of the node's port. TCG unless /dev/kvm is
ordinary KVM, as ``Vm``.
"""

import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from xml.sax.saxutils import escape, quoteattr

from ironic_image_worker_deploy.tests import real_ironic

import console

LIBVIRT_URI = 'qemu:///system'
# The SeaBIOS QEMU loads for a ``pc`` machine: named in the domain and in
# sushy's boot loader map, so a Legacy boot mode set through Redfish keeps
# it (sushy rebuilds the loader element from its map).
SEABIOS = '/usr/share/seabios/bios-256k.bin'
ISOLINUX_BIN = '/usr/lib/ISOLINUX/isolinux.bin'
SUSHY_VENV = os.environ.get(
    'IIW_SUSHY_VENV', '/var/tmp/ironic-image-worker/sushy-venv')


def virsh(*args, check=True):
    """``virsh`` on the system libvirt; its output."""
    proc = subprocess.run(('virsh', '-q', '-c', LIBVIRT_URI) + args,
                          stdin=subprocess.DEVNULL, capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        raise AssertionError('virsh %s: %s' % (' '.join(args),
                                               proc.stderr.strip()))
    return proc.stdout


def check_ready():
    """Fails at once, saying what is missing, rather than in Ironic's or
    sushy's logs minutes later."""
    missing = [path for path in (SEABIOS, ISOLINUX_BIN,
                                 os.path.join(SUSHY_VENV, 'bin',
                                              'sushy-emulator'))
               if not os.path.exists(path)]
    if missing:
        raise AssertionError('--boot redfish needs %s (.ci/run installs '
                             'them)' % ', '.join(missing))
    virsh('version')


class Pool(object):
    """A transient libvirt directory pool: where sushy uploads the virtual
    media it inserts (its volumes go with the pool's directory)."""

    def __init__(self, workdir):
        self.name = 'iiw-%s' % uuid.uuid4().hex[:12]
        self.dir = tempfile.mkdtemp(prefix='pool-', dir=workdir)
        virsh('pool-create-as', self.name, 'dir', '--target', self.dir)

    def stop(self):
        virsh('pool-destroy', self.name, check=False)


class Machine(console.SerialConsole):
    """A libvirt domain (not started: Ironic powers it on through sushy)
    with a blank disk of ``disk_size`` bytes and the NIC ``mac``; its agent
    is reached on 127.0.0.1:``agent_port`` and it reaches ``ports`` of the
    host. Its kernel command line is not here: Ironic puts the node's
    ``driver_info/kernel_append_params`` on the ISO it boots (``node``)."""

    def __init__(self, workdir, mac, ports, disk_size, accel, memory=1536):
        self.dir = tempfile.mkdtemp(prefix='vm-', dir=workdir)
        self.name = 'iiw-%s' % uuid.uuid4().hex[:12]
        self.disk = os.path.join(self.dir, 'disk.raw')
        with open(self.disk, 'wb') as f:
            f.truncate(disk_size)
        self.console = os.path.join(self.dir, 'console.log')
        self.agent_port = real_ironic.free_port()
        self.ports = sorted(set(ports))
        self.accel = accel
        netdev = ['user', 'id=n0', 'restrict=on',
                  'hostfwd=tcp:127.0.0.1:%d-:9999' % self.agent_port]
        netdev += ['guestfwd=tcp:10.0.2.100:%d-cmd:socat - TCP:127.0.0.1:%d'
                   % (p, p) for p in self.ports]
        args = ['-netdev', ','.join(netdev),
                # Slot 0x10: away from the slots libvirt gives its own
                # devices.
                '-device', 'virtio-net-pci,netdev=n0,mac=%s,bus=pci.0,'
                'addr=0x10' % mac]
        xml = DOMAIN_XML % {
            'type': 'kvm' if accel == 'kvm' else 'qemu',
            'name': self.name, 'memory': memory,
            'seabios': escape(SEABIOS), 'disk': quoteattr(self.disk),
            'console': quoteattr(self.console),
            'args': '\n'.join('    <qemu:arg value=%s/>' % quoteattr(a)
                              for a in args)}
        path = os.path.join(self.dir, 'domain.xml')
        with open(path, 'w') as f:
            f.write(xml)
        virsh('define', path)
        self.uuid = virsh('domuuid', self.name).strip()
        # Set by deploy.py as the deploy starts.
        self.started = None

    def state(self):
        return virsh('domstate', self.name, check=False).strip()

    def wait_off(self, within):
        """The deploy's end: the agent powered the machine off (its kernel
        says so on the console) and Ironic powered it on again from its
        disk, as on real hardware. The disk is read with the machine
        stopped, so it is stopped here (what it boots is the test's image,
        not an operating system). Returns the seconds since the deploy
        started."""
        deadline = time.monotonic() + within
        while self.state() != 'running':
            if time.monotonic() > deadline:
                raise AssertionError('the machine was not powered on from '
                                     'its disk within %ss:\n%s'
                                     % (within, self.tail()))
            time.sleep(0.5)
        virsh('destroy', self.name)
        if 'reboot: Power down' not in self.console_text():
            raise AssertionError('the agent did not power the machine off '
                                 '(Ironic did):\n%s' % self.tail())
        return time.monotonic() - self.started

    def stop(self):
        """Powers off (a second undeploy boot reuses the domain)."""
        if self.state() == 'running':
            virsh('destroy', self.name, check=False)

    def remove(self):
        self.stop()
        virsh('undefine', self.name, check=False)


DOMAIN_XML = """<domain type='%(type)s'
        xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>%(name)s</name>
  <memory unit='MiB'>%(memory)d</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <loader type='rom' readonly='yes'>%(seabios)s</loader>
    <boot dev='hd'/>
  </os>
  <features><acpi/><apic/></features>
  <clock offset='utc'><timer name='hpet' present='yes'/></clock>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>restart</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='unsafe'/>
      <source file=%(disk)s/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <controller type='usb' model='none'/>
    <serial type='file'>
      <source path=%(console)s append='on'/>
      <target port='0'/>
    </serial>
    <video><model type='none'/></video>
    <memballoon model='none'/>
  </devices>
  <qemu:commandline>
%(args)s
  </qemu:commandline>
</domain>
"""


class Sushy(console.LoggedProcess):
    """sushy-tools' Redfish emulator on 127.0.0.1, its libvirt driver
    limited to ``machines``' domains, inserting virtual media into
    ``pool``."""

    def __init__(self, workdir, pool, machines):
        self.dir = tempfile.mkdtemp(prefix='sushy-', dir=workdir)
        self.port = real_ironic.free_port()
        config = os.path.join(self.dir, 'emulator.conf')
        with open(config, 'w') as f:
            f.write('SUSHY_EMULATOR_LISTEN_IP = %r\n'
                    'SUSHY_EMULATOR_LISTEN_PORT = %d\n'
                    'SUSHY_EMULATOR_LIBVIRT_URI = %r\n'
                    'SUSHY_EMULATOR_ALLOWED_INSTANCES = %r\n'
                    'SUSHY_EMULATOR_STORAGE_POOL = %r\n'
                    'SUSHY_EMULATOR_STATE_DIR = %r\n'
                    'SUSHY_EMULATOR_BOOT_LOADER_MAP = %r\n'
                    # Power, boot and virtual media only: with the full set,
                    # the SecureBoot resource of a Legacy machine answers
                    # 501, which Ironic's sushy retries for 30 s each time
                    # Ironic looks (at every verify, deploy and cleaning).
                    'SUSHY_EMULATOR_FEATURE_SET = %r\n'
                    % ('127.0.0.1', self.port, LIBVIRT_URI,
                       [m.uuid for m in machines] + [m.name for m in machines],
                       pool.name, self.dir,
                       {'Legacy': {'x86_64': SEABIOS},
                        'UEFI': {'x86_64': None}}, 'vmedia'))
        self.log_path = os.path.join(self.dir, 'sushy.log')
        self.log = open(self.log_path, 'ab')
        # Its downloads of the ISOs in its own directory, not /tmp.
        environ = dict(os.environ, TMPDIR=self.dir)
        self.proc = subprocess.Popen(
            [os.path.join(SUSHY_VENV, 'bin', 'sushy-emulator'),
             '--config', config],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            env=environ)
        self.url = 'http://127.0.0.1:%d' % self.port
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError('sushy-emulator exited:\n%s'
                                     % self.tail())
            try:
                with urllib.request.urlopen(self.url + '/redfish/v1/',
                                            timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError('sushy-emulator did not start:\n%s'
                                         % self.tail())
                time.sleep(0.2)



def ironic_options(ramdisk):
    """Ironic's sections for redfish nodes (on top of deploy.py's): only
    the ``redfish`` hardware type and its interfaces, ``direct-worker``
    added to it by the plug-in's ``extend_hardware_types`` (as for Metal3,
    whose nodes' type follows the BMC address), the BIOS ISO's boot
    loader, the ISO published on ``[deploy]http_url`` (no Swift), and the
    ramdisk's directory allowed for ``file://`` URLs."""
    return {
        'DEFAULT': {
            'enabled_hardware_types': 'redfish',
            'enabled_deploy_interfaces': 'direct-worker,direct',
            'enabled_boot_interfaces': 'redfish-virtual-media',
            'enabled_power_interfaces': 'redfish',
            'enabled_management_interfaces': 'redfish',
            'isolinux_bin': ISOLINUX_BIN,
        },
        'image_worker': {'extend_hardware_types': 'redfish'},
        'redfish': {'use_swift': 'false'},
        'conductor': {'file_url_allowed_paths': os.path.realpath(ramdisk)},
        # The agent powers the machine off at the deploy's end; Ironic
        # waits for that (through sushy) before it powers it off itself.
        'agent': {'post_deploy_get_power_state_retries': '30',
                  'post_deploy_get_power_state_retry_interval': '2'},
    }


def node(ironic, machine, sushy, ramdisk, mac, kernel_params, deploy):
    """A node on ``redfish`` for ``machine`` (port ``mac``), made
    ``available``, with ``deploy`` as its deploy interface."""
    ramdisk = os.path.realpath(ramdisk)
    body = {
        'driver': 'redfish',
        'deploy_interface': deploy,
        'boot_interface': 'redfish-virtual-media',
        'properties': {'capabilities': 'boot_mode:bios'},
        'driver_info': {
            'redfish_address': sushy.url,
            'redfish_system_id': '/redfish/v1/Systems/%s' % machine.uuid,
            'redfish_username': 'admin', 'redfish_password': 'password',
            'deploy_kernel': 'file://%s/vmlinuz' % ramdisk,
            'deploy_ramdisk': 'file://%s/initramfs' % ramdisk,
            'kernel_append_params': kernel_params,
        },
    }
    created = ironic.call('POST', '/v1/nodes', body)
    ironic.call('POST', '/v1/ports', {'node_uuid': created['uuid'],
                                      'address': mac})
    for target, state in (('manage', 'manageable'), ('provide', 'available')):
        ironic.provision(created['uuid'], target)
        deadline = time.monotonic() + 120
        while True:
            got = ironic.get(created['uuid'])
            if got['target_provision_state'] is None:
                break
            if time.monotonic() > deadline:
                raise AssertionError('node %s stuck in %s' % (
                    created['uuid'], got['provision_state']))
            time.sleep(0.5)
        if got['provision_state'] != state:
            raise AssertionError('node %s is %s, not %s: %s\n%s' % (
                created['uuid'], got['provision_state'], state,
                got['last_error'], sushy.tail()))
    created['mac'] = mac
    return created
