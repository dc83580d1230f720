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


"""The ironic.conf snippets of the operator guide, read as Ironic reads them.

Operators copy ``docs/operations.md``'s ironic.conf blocks and the
``OS_<GROUP>__<OPTION>`` variables of ``ops/kubernetes/metal3-sidecar.yaml``
as they are, and oslo.config forgives little and says less: a comment after
a value is part of the value (a number or a choice then fails when read, a
string takes it silently), an option nobody registered is ignored, and a
conductor whose enabled hardware types have no default deploy interface
refuses to start. So each snippet is loaded
here with a fresh oslo.config holding Ironic's, oslo.messaging's, oslo.log's
and the plug-in's options, and its deploy interface settings are applied to
Ironic's driver factory as a conductor applies them at start.

A block of the guide (4-space indented, after a blank line) is an ironic.conf
snippet when it has a ``[section]`` line and is not TOML: the worker's own
configuration is TOML, with quoted values.
"""

import copy
import importlib.metadata
import pathlib
import re
import tomllib

from ironic.common import driver_factory
from ironic.common import exception as ironic_exception
from ironic.conf import opts as ironic_opts
from keystoneauth1 import loading as ks_loading
from oslo_config import cfg
from oslo_log import log
from oslo_messaging import opts as messaging_opts
import yaml

from ironic_image_worker_deploy import conf as worker_conf
from ironic_image_worker_deploy import supported
from ironic_image_worker_deploy.tests import base

ROOT = pathlib.Path(__file__).resolve().parents[4]
GUIDE = ROOT / 'docs' / 'operations.md'
SIDECAR = ROOT / 'ops' / 'kubernetes' / 'metal3-sidecar.yaml'

SECTION = re.compile(r'^\[[^\]\n]+\]', re.MULTILINE)


def _text(path):
    if not path.is_file():
        raise FileNotFoundError('%s is missing: this test checks it' % path)
    return path.read_text()


def _label(where, text):
    """``where`` and the snippet's first two lines that are no comment."""
    lines = [line for line in text.splitlines()
             if line.strip() and not line.startswith('#')]
    return '%s (%s)' % (where, ' '.join(lines[:2])[:48])


def _is_ironic_conf(text):
    if not SECTION.search(text):
        return False
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return True
    return False


def guide_snippets():
    """The ironic.conf snippets of the guide, labelled with their line."""
    blocks, block, fenced, previous = [], None, False, ''
    for number, line in enumerate(_text(GUIDE).splitlines(), 1):
        indented = line.startswith('    ')
        if block is not None and (indented or not line.strip()):
            block.append(line[4:])
        else:
            fenced ^= line.startswith('```')
            block = None
            after_blank = line.strip() and not previous.strip()
            if indented and after_blank and not fenced:
                block = [line[4:]]
                blocks.append((number, block))
        previous = line
    texts = [(number, '\n'.join(block).strip('\n') + '\n')
             for number, block in blocks]
    return [(_label('docs/operations.md line %d' % number, text), text)
            for number, text in texts if _is_ironic_conf(text)]


def sidecar_snippet():
    """The ironic container's ``OS_<GROUP>__<OPTION>`` variables as an
    ironic.conf; a value from a Secret or a field becomes a placeholder."""
    sections = {}
    for doc in yaml.safe_load_all(_text(SIDECAR)):
        if not doc or doc.get('kind') != 'Pod':
            continue
        for container in doc['spec']['containers']:
            for env in container.get('env', ()):
                name = re.fullmatch(r'OS_([A-Z0-9_]+?)__([A-Z0-9_]+)',
                                    env['name'])
                if container['name'] != 'ironic' or name is None:
                    continue
                group, option = name.group(1).lower(), name.group(2).lower()
                sections.setdefault(
                    'DEFAULT' if group == 'default' else group, []).append(
                        '%s = %s' % (option, env.get('value', 'FROM-SECRET')))
    if not sections:
        raise AssertionError('%s: no OS_<GROUP>__<OPTION> variable in its '
                             'ironic container' % SIDECAR)
    text = ''.join('[%s]\n%s\n\n' % (group, '\n'.join(options))
                   for group, options in sections.items())
    return 'ops/kubernetes/metal3-sidecar.yaml, container ironic', text


def _optional(opt):
    # Ironic's list_opts() lists keystoneauth's password plug-in options
    # (auth_url required) for its sample configuration; Ironic registers and
    # requires them only in a section whose auth_type names that plug-in.
    if not opt.required:
        return opt
    opt = copy.copy(opt)
    opt.required = False
    return opt


def ironic_conf():
    """A fresh configuration with the options an Ironic conductor reads."""
    conf = cfg.ConfigOpts()
    for group, opts in ironic_opts.list_opts() + messaging_opts.list_opts():
        conf.register_opts([_optional(opt) for opt in opts],
                           group=None if group == 'DEFAULT' else group)
    log.register_options(conf)
    worker_conf.register_opts(conf)
    # Registered by keystoneauth when it loads [image_worker_json_rpc]
    # auth_type = http_basic.
    conf.register_opts(ks_loading.get_auth_plugin_conf_options('http_basic'),
                       group=worker_conf.JSON_RPC_GROUP)
    return conf


def _read(conf, section, option):
    return (conf if section == 'DEFAULT' else conf[section])[option]


class SnippetsTestCase(base.TestCase):
    """One test per snippet (added below the class), named after it."""

    def test_the_guide_has_its_snippets(self):
        # The deploy interface's, without RabbitMQ, notifications, the TLS
        # cluster: an extraction that finds none tests nothing.
        self.assertGreaterEqual(len(guide_snippets()), 4)

    def _load(self, where, text):
        """The snippet read as the conductor reads its ironic.conf: the
        configuration and the options the snippet sets."""
        conf = ironic_conf()
        [path] = self.create_tempfiles([('ironic', text)])
        try:
            conf(['--config-file', path], project='ironic',
                 default_config_files=[], default_config_dirs=[],
                 use_env=False)
        except cfg.Error as e:
            self.fail('%s: oslo.config cannot read it: %s: %s'
                      % (where, type(e).__name__, e))
        sections = {}
        cfg.ConfigParser(path, sections).parse()
        problems = []
        for section, options in sections.items():
            for option, values in options.items():
                try:
                    _read(conf, section, option)
                except (cfg.NoSuchOptError, cfg.NoSuchGroupError):
                    problems.append(
                        '[%s]%s is no option of Ironic, oslo.messaging, '
                        'oslo.log or the plug-in: oslo.config ignores it'
                        % (section, option))
                except cfg.Error as e:
                    problems.append('[%s]%s: %s: %s'
                                    % (section, option, type(e).__name__, e))
                else:
                    # A string option takes a comment without a word.
                    problems.extend(
                        '[%s]%s = %s: the comment is part of the value'
                        % (section, option, value)
                        for value in values if re.search(r'\s#', value))
        if problems:
            self.fail('%s:\n%s' % (where, '\n'.join(problems)))
        return conf, sections

    def _check_default_deploy_interfaces(self, where, conf):
        """Apply the snippet's hardware types and deploy interfaces to
        Ironic's CONF, and find each type's default deploy interface."""
        self.config(
            enabled_hardware_types=conf.enabled_hardware_types,
            enabled_deploy_interfaces=conf.enabled_deploy_interfaces,
            default_deploy_interface=conf.default_deploy_interface,
            autodetect_deploy_interfaces=conf.autodetect_deploy_interfaces)
        extend = conf.image_worker.extend_hardware_types
        self.config(extend_hardware_types=extend, group='image_worker')
        for entry_point in importlib.metadata.entry_points(
                group=supported.HARDWARE_TYPES):
            self.addCleanup(supported.withdraw, entry_point.load())
        # As the conductor starts: the deploy interfaces first (creating
        # direct-worker applies extend_hardware_types), then the types. Either
        # fails on a name that is not an entry point of Ironic or the plug-in.
        driver_factory.interfaces('deploy')
        defaults, refused = {}, []
        for name, hw_type in driver_factory.hardware_types().items():
            try:
                defaults[name] = driver_factory.default_interface(
                    hw_type, 'deploy', driver_name=name)
            except ironic_exception.NoValidDefaultForInterface as e:
                refused.append(str(e))
        if refused:
            self.fail('%s: the conductor would not start:\n%s'
                      % (where, '\n'.join(refused)))
        self.assertIn('direct-worker', defaults.values(),
                      '%s: no enabled hardware type defaults to '
                      'direct-worker (deploy interface of each: %s)'
                      % (where, defaults))

    def _check(self, where, text):
        conf, sections = self._load(where, text)
        if {'enabled_hardware_types', 'default_deploy_interface'} & set(
                sections.get('DEFAULT', ())):
            self._check_default_deploy_interfaces(where, conf)


def _add_test(where, text):
    def test(self):
        self._check(where, text)
    test.__name__ = 'test_' + re.sub(r'\W+', '_', where).strip('_')
    test.__doc__ = where
    setattr(SnippetsTestCase, test.__name__, test)


for _snippet in guide_snippets() + [sidecar_snippet()]:
    _add_test(*_snippet)
