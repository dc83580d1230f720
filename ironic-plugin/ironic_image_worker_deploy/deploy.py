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

import abc

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
from ironic_image_worker_deploy import conf as worker_conf
from ironic_image_worker_deploy import exception

LOG = log.getLogger(__name__)

METRICS = metrics_utils.get_metrics_logger(__name__)

# What the worker reports about the served file, copied into instance_info
# when present (an http(s) source in ``http`` download mode is not served by
# the worker: only what it was given comes back).
_SERVED_FIELDS = ('image_checksum', 'image_os_hash_algo',
                  'image_os_hash_value', 'image_disk_format', 'image_size')


class _SupportedWhereDirectIs(abc.ABCMeta):
    """Makes hardware types that support ``direct`` accept this interface.

    Ironic accepts an interface for a hardware type only when its exact
    class is in the type's ``supported_deploy_interfaces`` list, and every
    in-tree hardware type (ipmi, redfish, idrac, manual-management, ...)
    lists ``AgentDeploy``. Comparing equal to ``AgentDeploy`` in that test
    makes ``direct-worker`` usable wherever ``direct`` is, without a
    hardware type of its own; hashing and ``isinstance`` are unchanged.
    """

    def __eq__(cls, other):
        return other is agent.AgentDeploy or type.__eq__(cls, other) is True

    __hash__ = abc.ABCMeta.__hash__


class DirectWorkerDeploy(agent.AgentDeploy,
                         metaclass=_SupportedWhereDirectIs):
    """Direct deploy with the image work done by ironic-image-worker."""

    def __init__(self):
        super().__init__()
        worker_conf.register_opts(CONF)

    def _client(self):
        return worker_client.WorkerClient(CONF)

    @staticmethod
    def _delegated(task):
        """Whether the worker can take this node's image.

        Ironic's own code keeps three cases the worker has nothing to cache
        for: ``swift`` downloads (the agent fetches a Swift temporary URL),
        OCI container images and sources that are a path (anaconda).
        """
        node = task.node
        source = node.instance_info.get('image_source') or ''
        if deploy_utils.get_image_download_source(node) == 'swift':
            return False
        if image_service.is_container_registry_url(source):
            return False
        return not node.driver_internal_info.get('is_source_a_path')

    def _update_instance_info(self, task):
        """Update instance information with extra data for deploy."""
        if not self._delegated(task):
            LOG.info('Image of node %(node)s is prepared by Ironic itself '
                     '(swift download, OCI image or source path)',
                     {'node': task.node.uuid})
            return super()._update_instance_info(task)
        task.node.instance_info = self._build_instance_info(task)
        task.node.save()

    @METRICS.timer('DirectWorkerDeploy._build_instance_info')
    def _build_instance_info(self, task):
        """The instance_info build_instance_info_for_deploy would build.

        The worker downloads, verifies, converts and hashes; the conductor
        only reads Glance's metadata (properties, container format, tags,
        kernel and ramdisk) as Ironic does for a Glance image.

        :raises: ImageWorkerError and its subclasses when the worker fails
            or does not answer in time.
        :raises: whatever Glance lookups or Ironic's parameter checks raise.
        """
        node = task.node
        instance_info = node.instance_info
        di_info = node.driver_internal_info
        iwdi = di_info.get('is_whole_disk_image')
        image_source = instance_info['image_source']
        # As Ironic: a saved override of image_source is stale now.
        di_info.pop('image_source', None)
        node.driver_internal_info = di_info
        download_source = deploy_utils.get_image_download_source(node)
        instance_info['image_url'] = None

        glance_info = None
        if service_utils.is_glance_image(image_source):
            glance = image_service.GlanceImageService(context=task.context)
            glance_info = glance.show(image_source)
            instance_info['image_checksum'] = glance_info['checksum']
            instance_info['image_os_hash_algo'] = glance_info['os_hash_algo']
            instance_info['image_os_hash_value'] = glance_info[
                'os_hash_value']
            declared_format = glance_info.get('disk_format')
        else:
            declared_format = instance_info.get('image_disk_format')

        request = {
            'image_source': image_source,
            'image_checksum': instance_info.get('image_checksum'),
            'image_os_hash_algo': instance_info.get('image_os_hash_algo'),
            'image_os_hash_value': instance_info.get('image_os_hash_value'),
            'image_disk_format': declared_format,
            'image_type': (images.IMAGE_TYPE_WHOLE_DISK if iwdi
                           else images.IMAGE_TYPE_PARTITION),
            'kernel': instance_info.get('kernel'),
            'ramdisk': instance_info.get('ramdisk'),
            'image_download_source': download_source,
        }
        request = {k: v for k, v in request.items() if v}
        options = {
            'force_raw': bool(
                deploy_utils.direct_deploy_should_convert_raw_image(node)),
            'stream_raw': bool(CONF.agent.stream_raw_images),
        }
        timeout = CONF.image_worker.prepare_timeout
        done = self._client().call('prepare', node.uuid,
                                   instance_info=request, options=options,
                                   timeout=timeout, expire=True)
        if done.get('status') != 'success' or not done.get('image_url'):
            error = done.get('error') or {}
            raise exception.ImageWorkerPrepareFailed(
                node=node.uuid, image_href=image_source,
                host=done.get('conductor_host'),
                error_code=error.get('code', 'internal'),
                reason=error.get('message',
                                 _('no image_url in the completion')))
        LOG.info('Image worker prepared %(image)s for node %(node)s '
                 '(cache %(cache)s, converted %(converted)s, %(ms)s ms)',
                 {'image': image_source, 'node': node.uuid,
                  'cache': done.get('cache'),
                  'converted': done.get('converted'),
                  'ms': done.get('duration_ms')})
        instance_info['image_url'] = done['image_url']
        for field in _SERVED_FIELDS:
            if field in done:
                instance_info[field] = done[field]

        if glance_info is not None:
            # Metadata Ironic copies from Glance for other interfaces.
            instance_info['image_container_format'] = (
                glance_info['container_format'])
            instance_info['image_tags'] = glance_info.get('tags', [])
            instance_info['image_properties'] = glance_info['properties']
            if not iwdi and deploy_utils.get_boot_option(node) != 'local':
                instance_info['kernel'] = (
                    glance_info['properties']['kernel_id'])
                instance_info['ramdisk'] = (
                    glance_info['properties']['ramdisk_id'])
            deploy_utils.check_image_size(node, glance_info)

        if not iwdi:
            instance_info['image_type'] = images.IMAGE_TYPE_PARTITION
            instance_info.update(deploy_utils.parse_instance_info(node))
        else:
            instance_info['image_type'] = images.IMAGE_TYPE_WHOLE_DISK
        return instance_info

    def _tell_worker(self, task, action):
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
        timeout = CONF.image_worker.command_timeout or None
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
