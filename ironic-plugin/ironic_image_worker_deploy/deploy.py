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

from oslo_log import log

from ironic.common.glance_service import service_utils
from ironic.common.i18n import _
from ironic.common import image_service
from ironic.common import images
from ironic.common import metrics_utils
from ironic.conductor import task_manager
from ironic.conf import CONF
from ironic.drivers import base
from ironic.drivers.modules import agent
from ironic.drivers.modules import deploy_utils

from ironic_image_worker_deploy import client as worker_client
# Importing conf registers the [image_worker] options, once per process.
from ironic_image_worker_deploy import conf as worker_conf  # noqa: F401
from ironic_image_worker_deploy import exception
from ironic_image_worker_deploy import hardware

LOG = log.getLogger(__name__)

METRICS = metrics_utils.get_metrics_logger(__name__)

# What the worker reports about the served file, copied into instance_info
# when present (an http(s) source in ``http`` download mode is not served by
# the worker: only what it was given comes back).
_SERVED_FIELDS = ('image_checksum', 'image_os_hash_algo',
                  'image_os_hash_value', 'image_disk_format', 'image_size')


class DirectWorkerDeploy(agent.AgentDeploy):
    """Direct deploy with the image work done by ironic-image-worker."""

    def _client(self):
        return worker_client.WorkerClient(CONF)

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

    def _update_instance_info(self, task):
        """Update instance information with extra data for deploy."""
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

    def _ask_worker(self, node, request, extra):
        """Send ``prepare`` and return the worker's successful answer.

        :raises: ImageWorkerError and its subclasses.
        """
        options = {
            'force_raw': bool(
                deploy_utils.direct_deploy_should_convert_raw_image(node)),
            'stream_raw': bool(CONF.agent.stream_raw_images),
        }
        done = self._client().call(
            'prepare', node.uuid, instance_info=request, options=options,
            timeout=CONF.image_worker.prepare_timeout, expire=True,
            extra=extra)
        if done.get('status') != 'success' or not done.get('image_url'):
            error = done.get('error') or {}
            raise exception.ImageWorkerPrepareFailed(
                node=node.uuid, image_href=request['image_source'],
                host=done.get('conductor_host'),
                error_code=error.get('code', 'internal'),
                reason=error.get('message',
                                 _('no image_url in the completion')),
                sent=True)
        LOG.info('Image worker prepared %(image)s for node %(node)s '
                 '(cache %(cache)s, converted %(converted)s, %(ms)s ms)',
                 {'image': request['image_source'], 'node': node.uuid,
                  'cache': done.get('cache'),
                  'converted': done.get('converted'),
                  'ms': done.get('duration_ms')})
        return done

    @METRICS.timer('DirectWorkerDeploy._build_instance_info')
    def _build_instance_info(self, task):
        """The instance_info build_instance_info_for_deploy would build.

        The worker downloads, verifies, converts and hashes (OCI images
        too: it resolves the artifact); the conductor only reads Glance's
        metadata (properties, container format, tags, kernel and ramdisk)
        as Ironic does for a Glance image.

        :raises: ImageWorkerError and its subclasses when the worker fails
            or does not answer in time.
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
        node.driver_internal_info = di_info
        instance_info['image_url'] = None
        # A registry token for the agent: the worker serves the image.
        instance_info.pop('image_request_authorization_secret', None)

        glance_info = self._glance_metadata(task, image_source, instance_info)
        declared_format = (glance_info.get('disk_format') if glance_info
                           else instance_info.get('image_disk_format'))
        request, extra = self._prepare_command(node, instance_info,
                                               declared_format, oci)
        done = self._ask_worker(node, request, extra)
        instance_info['image_url'] = done['image_url']
        for field in _SERVED_FIELDS:
            if field in done:
                instance_info[field] = done[field]
        if oci:
            self._record_oci(node, instance_info, done)

        if glance_info is not None:
            self._copy_glance_metadata(node, instance_info, glance_info)

        if not iwdi:
            instance_info['image_type'] = images.IMAGE_TYPE_PARTITION
            instance_info.update(deploy_utils.parse_instance_info(node))
        else:
            instance_info['image_type'] = images.IMAGE_TYPE_WHOLE_DISK
        return instance_info

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
            done = self._client().call(action, node.uuid, timeout=timeout)
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


# Accepted by every hardware type that accepts ``direct`` (see hardware.py).
hardware.accept_where_direct_is(DirectWorkerDeploy)
