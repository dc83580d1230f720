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

"""The ``direct-worker`` deploy interface.

Ironic's ``direct`` deploy interface (``AgentDeploy``), except that the
instance image is cached, verified, converted, hashed and served by
ironic-image-worker on the conductor host instead of by the conductor
itself. The conductor sends the worker a ``prepare`` command with its own
decisions (force_raw, checksums, disk format, image type, download source)
and fills ``instance_info`` from the worker's answer the way
``deploy_utils.build_instance_info_for_deploy`` fills it when it caches the
image itself; ``deployed`` and ``cleanup`` commands withdraw the node's files
where Ironic removes its own.
"""

import time
from urllib import parse as urlparse

from oslo_log import log

from ironic.common import async_steps
from ironic.common import exception as ironic_exception
from ironic.common.glance_service import service_utils
from ironic.common.i18n import _
from ironic.common import image_service
from ironic.common import images
from ironic.common import metrics_utils
from ironic.common import states
from ironic.conductor import periodics
from ironic.conductor import task_manager
from ironic.conductor import utils as manager_utils
from ironic.conf import CONF
from ironic.drivers import base
from ironic.drivers.modules import agent
from ironic.drivers.modules import deploy_utils

from ironic_image_worker_deploy import client as worker_client
# Importing conf registers the [image_worker] options, once per process.
from ironic_image_worker_deploy import conf as worker_conf  # noqa: F401
from ironic_image_worker_deploy import exception
from ironic_image_worker_deploy import json_rpc as worker_json_rpc
from ironic_image_worker_deploy import supported

LOG = log.getLogger(__name__)

METRICS = metrics_utils.get_metrics_logger(__name__)

# What the worker reports about the served file, copied into instance_info
# when present (an http(s) source in ``http`` download mode is not served by
# the worker: only what it was given comes back). ``image_checksum`` is
# apart: see ``apply_answer``.
_SERVED_FIELDS = ('image_os_hash_algo', 'image_os_hash_value',
                  'image_disk_format', 'image_size')

# driver_internal_info: the prepare sent and not collected yet
# ({'request_id', 'deadline' (epoch seconds), 'done' once collected}).
PENDING = 'image_worker_prepare'


# The re-asks of the prepares this conductor waits for, by request id (in
# memory: a conductor that restarts asks again from the first interval),
# forgotten once answered; bounded.
_REASKS = {}
_MAX_REASKS = 10000


def _waiting_for_the_worker(node):
    """The periodic's predicate: a node whose prepare is under way, or
    whose ``write_image`` waits for an answer collected already. A node
    whose answer is collected while its ramdisk still boots is left alone:
    ``write_image`` takes the answer when the agent is ready, and locking
    the node at every poll would make Ironic skip the agent's heartbeats
    ("currently locked") and the deploy wait for the next one."""
    info = node.driver_internal_info or {}
    pending = info.get(PENDING)
    if pending is None:
        return False
    return not pending.get('done') or bool(
        info.get(async_steps.DEPLOYMENT_POLLING))


def apply_answer(instance_info, done):
    """``instance_info`` filled from the worker's successful answer to a
    prepare: its ``image_url`` and what it reports about the served bytes.

    ``image_checksum`` is the worker's or none: a checksum the answer does
    not carry (a worker that serves no MD5) would be of other bytes (the
    source before its conversion), and Ironic itself clears it when it
    converts (``build_instance_info_for_deploy``); the agent then verifies
    ``image_os_hash_value``.
    """
    instance_info['image_url'] = done['image_url']
    instance_info['image_checksum'] = done.get('image_checksum')
    for field in _SERVED_FIELDS:
        if field in done:
            instance_info[field] = done[field]
    return instance_info


def passed_through(node):
    """The source URL the worker answers the node's prepare with, when it
    passes the source through (an http(s) source in ``image_download_source
    = http`` mode, what ``_prepare_command`` sends); None when it publishes
    the image itself. Only that answer is taken (``answer.is_answer``)."""
    source = (node.instance_info.get('image_source') or '').strip()
    if (deploy_utils.get_image_download_source(node) == 'http'
            and urlparse.urlsplit(source).scheme in ('http', 'https')):
        return source
    return None


def client_for(conf, context=None):
    """The worker's client for ``[image_worker]transport``."""
    if conf.image_worker.transport == 'json-rpc':
        return worker_json_rpc.JsonRpcWorkerClient(conf, context=context)
    return worker_client.WorkerClient(conf)


class DirectWorkerDeploy(agent.AgentDeploy):
    """Direct deploy with the image work done by ironic-image-worker."""

    def __init__(self):
        super().__init__()
        # Ironic creates its enabled interfaces before it asks a hardware
        # type which of them it supports, and after the configuration is
        # read: the operator's opt-in is applied here (see supported.py).
        supported.accept_in(CONF.image_worker.extend_hardware_types,
                            DirectWorkerDeploy)

    def _client(self, task=None):
        """The worker's client for [image_worker]transport."""
        return client_for(CONF, task.context if task is not None else None)

    @METRICS.timer('DirectWorkerDeploy.validate')
    def validate(self, task):
        """Ironic's checks, then what the agent needs for the worker's URL.

        :raises: InvalidParameterValue naming the option to set when the
            worker's image port requires credentials the agent would not
            be given.
        """
        super().validate(task)
        if not CONF.image_worker.image_server_auth or not self._delegated(
                task):
            return
        deploy = CONF.deploy
        if (deploy.image_server_auth_strategy != 'http_basic'
                or not deploy.image_server_user
                or not deploy.image_server_password):
            raise ironic_exception.InvalidParameterValue(_(
                "[image_worker]image_server_auth says the image worker's "
                "port requires HTTP Basic, but the agent would get no "
                "credentials: set [deploy]image_server_auth_strategy = "
                "http_basic with [deploy]image_server_user and "
                "image_server_password (the worker's [http]auth_user and "
                "auth_password)"))
        if not image_service.is_host_auth_permitted(deploy.http_url or ''):
            raise ironic_exception.InvalidParameterValue(_(
                "[image_worker]image_server_auth says the image worker's "
                "port requires HTTP Basic, but the credentials may not go "
                "to %(url)s: add its host to "
                "[deploy]image_server_auth_hosts") % {
                    'url': deploy.http_url})

    @staticmethod
    def _delegated(task):
        """Whether the worker can take this node's image.

        Ironic's own code keeps two cases the worker has nothing to cache
        for: ``swift`` downloads (the agent fetches a Swift temporary URL)
        and sources that are a path (anaconda). OCI images (``oci://``)
        are the worker's, as any other source.
        """
        node = task.node
        if deploy_utils.get_image_download_source(node) == 'swift':
            return False
        return not node.driver_internal_info.get('is_source_a_path')

    # NOTE: a private method of Ironic's, overridden on purpose. It is the
    # hook ``CustomAgentDeploy.prepare`` calls (its docstring: "Called from
    # `prepare` to populate fields ... Does nothing in the base class"),
    # which ``AgentDeploy`` itself overrides to cache and hash the image in
    # the conductor; Ironic 39 has no public hook at that point (after the
    # provisioning network is set up, before the agent boots) and
    # overriding the public ``prepare`` would mean copying it. Pinned by
    # tests/unit/test_ironic_hooks.py: its signature, and that Ironic's
    # ``prepare`` reaches it.
    def _update_instance_info(self, task):
        """Send the prepare to the worker (Ironic's hook in ``prepare``)."""
        if not self._delegated(task):
            LOG.info('Image of node %(node)s is prepared by Ironic itself '
                     '(swift download or source path)',
                     {'node': task.node.uuid})
            return super()._update_instance_info(task)
        try:
            task.node.instance_info = self._build_instance_info(task)
        except Exception as e:
            self._withdraw_after_failure(task, e)
            raise
        task.node.save()

    def _withdraw_after_failure(self, task, error):
        """Send ``cleanup`` after a failed prepare; never raises.

        Ironic calls ``clean_up`` after failures of later steps, not after
        a failure in this one, so a worker that finishes the prepare after
        the interface gave up (a timeout), or an earlier prepare's files,
        would leave the node published. The worker runs a node's commands
        in order, so the cleanup follows the prepare. Bounded by
        [image_worker]command_timeout; not waited for when no worker
        consumes (it is done when one is back); not sent when the prepare
        never reached the worker's queue.
        """
        if isinstance(error, exception.ImageWorkerError) and not error.sent:
            return
        wait = not isinstance(error, exception.ImageWorkerNotConsuming)
        LOG.info('Prepare of node %(node)s failed, asking the image worker '
                 'to withdraw its files', {'node': task.node.uuid})
        try:
            self._tell_worker(task, 'cleanup', wait=wait)
        except Exception:  # noqa: the prepare's own error is what counts
            LOG.exception('Cleanup after the failed prepare of node %s '
                          'failed', task.node.uuid)

    @staticmethod
    def _glance_metadata(task, image_source, instance_info):
        """Glance's record of the image (metadata only), or None."""
        if not service_utils.is_glance_image(image_source):
            return None
        glance = image_service.GlanceImageService(context=task.context)
        glance_info = glance.show(image_source)
        instance_info['image_checksum'] = glance_info['checksum']
        instance_info['image_os_hash_algo'] = glance_info['os_hash_algo']
        instance_info['image_os_hash_value'] = glance_info['os_hash_value']
        return glance_info

    @staticmethod
    def _prepare_command(node, instance_info, declared_format, oci):
        """The ``prepare`` command's instance_info and top-level extras.

        For an OCI image, the pull secret Ironic would use
        (``instance_info`` first, then ``driver_info``, as
        ``get_image_service_auth_override`` picks it) and the node's
        ``cpu_arch`` (which artifact of a multi-architecture index).
        """
        iwdi = node.driver_internal_info.get('is_whole_disk_image')
        request = {
            'image_source': instance_info['image_source'],
            'image_checksum': instance_info.get('image_checksum'),
            'image_os_hash_algo': instance_info.get('image_os_hash_algo'),
            'image_os_hash_value': instance_info.get('image_os_hash_value'),
            'image_disk_format': declared_format,
            'image_type': (images.IMAGE_TYPE_WHOLE_DISK if iwdi
                           else images.IMAGE_TYPE_PARTITION),
            'kernel': instance_info.get('kernel'),
            'ramdisk': instance_info.get('ramdisk'),
            'image_download_source':
                deploy_utils.get_image_download_source(node),
        }
        extra = {}
        if oci:
            request['image_pull_secret'] = (
                instance_info.get('image_pull_secret')
                or node.driver_info.get('image_pull_secret'))
            if node.properties.get('cpu_arch'):
                extra['properties'] = {
                    'cpu_arch': node.properties['cpu_arch']}
        return {k: v for k, v in request.items() if v}, extra

    @staticmethod
    def _options(node):
        return {
            'force_raw': bool(
                deploy_utils.direct_deploy_should_convert_raw_image(node)),
            'stream_raw': bool(CONF.agent.stream_raw_images),
        }

    @staticmethod
    def _raise_if_failed(node, request_source, done):
        if done.get('status') != 'success' or not done.get('image_url'):
            error = done.get('error') or {}
            raise exception.ImageWorkerPrepareFailed(
                node=node.uuid, image_href=request_source,
                host=done.get('conductor_host'),
                error_code=error.get('code', 'internal'),
                reason=error.get('message',
                                 _('no image_url in the completion')),
                sent=True)
        LOG.info('Image worker prepared %(image)s for node %(node)s '
                 '(cache %(cache)s, converted %(converted)s, %(ms)s ms)',
                 {'image': request_source, 'node': node.uuid,
                  'cache': done.get('cache'),
                  'converted': done.get('converted'),
                  'ms': done.get('duration_ms')})

    @METRICS.timer('DirectWorkerDeploy._build_instance_info')
    def _build_instance_info(self, task):
        """The instance_info build_instance_info_for_deploy would build,
        less what the worker answers (``image_url`` and the served bytes'
        checksums, format and size, filled in by ``_collect``).

        The prepare is sent here, as the deploy starts, and not waited
        for: the worker downloads, verifies, converts and hashes while the
        node boots its ramdisk (OCI images too: it resolves the artifact).
        The conductor only reads Glance's metadata (properties, container
        format, tags, kernel and ramdisk) as Ironic does for a Glance
        image.

        :raises: ImageWorkerError and its subclasses when the worker cannot
            be sent the command.
        :raises: whatever Glance lookups or Ironic's parameter checks raise.
        """
        node = task.node
        instance_info = node.instance_info
        di_info = node.driver_internal_info
        iwdi = di_info.get('is_whole_disk_image')
        image_source = instance_info['image_source']
        oci = image_service.is_container_registry_url(image_source)
        # As Ironic: a saved override of image_source is stale now.
        di_info.pop('image_source', None)
        di_info.pop(PENDING, None)
        node.driver_internal_info = di_info
        # No URL until the worker published one (what is set is served).
        instance_info['image_url'] = None
        # A registry token for the agent: the worker serves the image.
        instance_info.pop('image_request_authorization_secret', None)

        glance_info = self._glance_metadata(task, image_source, instance_info)
        declared_format = (glance_info.get('disk_format') if glance_info
                           else instance_info.get('image_disk_format'))
        request, extra = self._prepare_command(node, instance_info,
                                               declared_format, oci)
        timeout = CONF.image_worker.prepare_timeout
        issued_ms = int(time.time() * 1000)
        request_id = self._client(task).send(
            'prepare', node.uuid, timeout=timeout, instance_info=request,
            options=self._options(node), extra=extra, issued_ms=issued_ms)
        node.set_driver_internal_info(PENDING, {
            'request_id': request_id,
            'deadline': time.time() + timeout,
            'issued_ms': issued_ms,
            'format': declared_format,
            'oci': oci})
        LOG.info('Sent prepare %(req)s of %(image)s for node %(node)s to '
                 'the image worker; collected when the agent is ready',
                 {'req': request_id, 'image': image_source,
                  'node': node.uuid})

        if glance_info is not None:
            self._copy_glance_metadata(node, instance_info, glance_info)

        if not iwdi:
            instance_info['image_type'] = images.IMAGE_TYPE_PARTITION
            instance_info.update(deploy_utils.parse_instance_info(node))
        else:
            instance_info['image_type'] = images.IMAGE_TYPE_WHOLE_DISK
        return instance_info

    def _poll(self, task):
        """The worker's answer to the node's prepare, if there is one yet
        (kept in driver_internal_info once collected): only the answer to
        this request is taken (``answer.is_answer``). A worker that cannot
        be reached now is asked again later."""
        pending = task.node.driver_internal_info[PENDING]
        if pending.get('done'):
            _REASKS.pop(pending['request_id'], None)
            return pending['done']
        try:
            done = self._client(task).collect(pending['request_id'],
                                              task.node.uuid,
                                              passed_through(task.node))
            if done is None:
                self._reask_if_due(task, pending)
            else:
                _REASKS.pop(pending['request_id'], None)
            return done
        except exception.ImageWorkerError as e:
            LOG.warning('Cannot ask the image worker about the prepare of '
                        'node %(node)s yet: %(error)s',
                        {'node': task.node.uuid, 'error': e})
            return None

    def _reask_if_due(self, task, pending):
        """Send the node's prepare again (same request id and issue time)
        when its answer is overdue ([image_worker]reask_after): an answer
        lost with a broker node is then given again (or the prepare worked
        again: a cache hit) within seconds. Over the broker only: the
        JSON-RPC transport asks the worker itself (``status``)."""
        client = self._client(task)
        if not isinstance(client, worker_client.WorkerClient):
            return
        now, request_id = time.time(), pending['request_id']
        if len(_REASKS) >= _MAX_REASKS and request_id not in _REASKS:
            _REASKS.clear()
        first = CONF.image_worker.reask_after
        reasks = _REASKS.setdefault(
            request_id,
            worker_client.Reasks(first, pending.get('issued_ms', 0) / 1000.0))
        if now >= pending['deadline'] or not reasks.due(now):
            return
        node = task.node
        request, extra = self._prepare_command(
            node, node.instance_info, pending.get('format'),
            pending.get('oci'))
        LOG.info('No answer of the image worker to prepare %(req)s of node '
                 '%(node)s yet: sending it again',
                 {'req': request_id, 'node': node.uuid})
        # The reply queue's arguments (its expiry) must be the first send's.
        client.send('prepare', node.uuid,
                    timeout=CONF.image_worker.prepare_timeout,
                    instance_info=request, options=self._options(node),
                    extra=extra, request_id=request_id,
                    issued_ms=pending.get('issued_ms'))

    def _collect(self, task, done=None):
        """Fill instance_info with the worker's answer, once there.

        :returns: True when filled in; False while the worker works and
            the prepare's deadline ([image_worker]prepare_timeout from the
            send) is ahead.
        :raises: ImageWorkerPrepareFailed (the worker's code and message),
            ImageWorkerTimeout past the deadline; the node's files are
            withdrawn first.
        """
        node = task.node
        pending = node.driver_internal_info[PENDING]
        source = node.instance_info.get('image_source')
        done = done or self._poll(task)
        try:
            if done is None:
                if time.time() < pending['deadline']:
                    return False
                raise exception.ImageWorkerTimeout(
                    node=node.uuid, host=CONF.image_worker.conductor_host
                    or CONF.host, action='prepare',
                    timeout=CONF.image_worker.prepare_timeout, sent=True)
            self._raise_if_failed(node, source, done)
        except exception.ImageWorkerError as e:
            node.del_driver_internal_info(PENDING)
            node.save()
            self._withdraw_after_failure(task, e)
            raise
        instance_info = apply_answer(node.instance_info, done)
        if pending.get('oci'):
            self._record_oci(node, instance_info, done)
        node.instance_info = instance_info
        node.del_driver_internal_info(PENDING)
        node.save()
        return True

    @METRICS.timer('DirectWorkerDeploy.write_image')
    @base.deploy_step(priority=80)
    @task_manager.require_exclusive_lock
    def write_image(self, task):
        """Collect the worker's prepare, then write the image as ``direct``.

        The agent is ready: if the worker has answered, its URL goes to the
        agent now. If it still works, the step waits (Ironic's polling
        flag: heartbeats do not move the deploy on) and
        ``_check_prepares`` resumes it once the answer is there.
        """
        if (task.driver.storage.should_write_image(task)
                and PENDING in task.node.driver_internal_info
                and not self._collect(task)):
            async_steps.set_node_flags(
                task.node, skip_current_step=False, polling=True)
            return states.DEPLOYWAIT
        return super().write_image(task)

    @METRICS.timer('DirectWorkerDeploy._check_prepares')
    @periodics.node_periodic(
        purpose='collecting image worker prepares',
        spacing=CONF.image_worker.poll_interval,
        filters={'provision_state': states.DEPLOYWAIT, 'reserved': False},
        predicate_extra_fields=['driver_internal_info'],
        predicate=_waiting_for_the_worker,
    )
    def _check_prepares(self, task, manager, context):
        """Periodically: a node waiting for the worker goes on."""
        self.check_prepare(task)

    def check_prepare(self, task):
        """Look at the node's prepare: a failure or the deadline fails the
        deploy at once (even while the ramdisk still boots); an answer
        resumes a ``write_image`` that waits for it."""
        done = self._poll(task)
        pending = task.node.driver_internal_info.get(PENDING) or {}
        if done is None and time.time() < pending.get('deadline', 0):
            return
        task.upgrade_lock(purpose='collecting an image worker prepare')
        node = task.node
        if (PENDING not in node.driver_internal_info
                or node.provision_state != states.DEPLOYWAIT):
            return
        waiting = node.driver_internal_info.get(
            async_steps.DEPLOYMENT_POLLING)
        if done is not None and done.get('status') == 'success':
            pending['done'] = done
            node.set_driver_internal_info(PENDING, pending)
            node.save()
            if waiting:
                async_steps.set_node_flags(
                    node, skip_current_step=False, polling=None)
                manager_utils.notify_conductor_resume_deploy(task)
            return
        try:
            self._collect(task, done)
        except exception.ImageWorkerError as e:
            deploy_utils.set_failed_state(task, str(e), collect_logs=False)

    @staticmethod
    def _record_oci(node, instance_info, done):
        """What Ironic records of an OCI artifact it resolved itself."""
        di_info = node.driver_internal_info
        manifest = done.get('oci_image_manifest_url')
        if manifest:
            instance_info['oci_image_manifest_url'] = manifest
            di_info['image_source'] = manifest
        di_info['container_image_type'] = 'oci_artifact'
        node.driver_internal_info = di_info

    @staticmethod
    def _copy_glance_metadata(node, instance_info, glance_info):
        """Metadata Ironic copies from Glance for other interfaces."""
        instance_info['image_container_format'] = (
            glance_info['container_format'])
        instance_info['image_tags'] = glance_info.get('tags', [])
        instance_info['image_properties'] = glance_info['properties']
        if (not node.driver_internal_info.get('is_whole_disk_image')
                and deploy_utils.get_boot_option(node) != 'local'):
            instance_info['kernel'] = glance_info['properties']['kernel_id']
            instance_info['ramdisk'] = (
                glance_info['properties']['ramdisk_id'])
        deploy_utils.check_image_size(node, glance_info)

    def _tell_worker(self, task, action, wait=True):
        """Send ``deployed`` or ``cleanup``; log, never raise.

        Waits up to [image_worker]command_timeout for the confirmation so
        that the worker has withdrawn the node's files before the node moves
        on (a redeploy's prepare cannot overtake the cleanup), but a worker
        or broker that is down never fails a deploy or a teardown.

        :returns: the worker's completion event, or None when none came.
        """
        if not self._delegated(task):
            return None
        node = task.node
        timeout = (CONF.image_worker.command_timeout or None) if wait else None
        try:
            done = self._client(task).call(action, node.uuid,
                                           timeout=timeout)
        except Exception as e:
            LOG.warning('Image worker did not confirm %(action)s for node '
                        '%(node)s: %(error)s',
                        {'action': action, 'node': node.uuid, 'error': e})
            return None
        if done is not None and done.get('status') != 'success':
            LOG.warning('Image worker failed %(action)s for node %(node)s: '
                        '%(error)s', {'action': action, 'node': node.uuid,
                                      'error': done.get('error')})
        return done

    @METRICS.timer('DirectWorkerDeploy.prepare_instance_boot')
    @base.deploy_step(priority=60)
    @task_manager.require_exclusive_lock
    def prepare_instance_boot(self, task):
        """Prepare the instance boot, then withdraw the node's image.

        Where Ironic's ``direct`` interface removes the symlink and the
        node's image (once the image is written), the worker is told
        ``deployed``.
        """
        super().prepare_instance_boot(task)
        if task.driver.storage.should_write_image(task):
            self._tell_worker(task, 'deployed')

    @METRICS.timer('DirectWorkerDeploy.clean_up')
    @task_manager.require_exclusive_lock
    def clean_up(self, task):
        """Clean up the deployment environment, worker's files included.

        Ironic calls this before ``tear_down`` on every teardown, and after
        a failed or aborted deploy, so ``cleanup`` is sent from here only;
        ``tear_down`` itself powers off and unconfigures networks.
        """
        try:
            super().clean_up(task)
        finally:
            self._tell_worker(task, 'cleanup')
