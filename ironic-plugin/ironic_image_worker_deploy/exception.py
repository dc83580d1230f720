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

"""Exceptions raised when the image worker cannot prepare an image."""

from ironic.common import exception
from ironic.common.i18n import _


class ImageWorkerError(exception.IronicException):
    """The image worker did not prepare the node's image.

    ``error_code`` is the worker's error code (one of the closed list of
    ``schemas/completion.v1.json``), or ``timeout`` / ``no_worker`` /
    ``broker_unreachable`` for failures on the way to the worker.
    ``sent`` tells whether the command reached the worker's queue, so that
    the worker may still act on it (its node's files then need a cleanup).
    """

    _msg_fmt = _("Image worker of conductor %(host)s failed for node "
                 "%(node)s: %(error_code)s: %(reason)s")

    def __init__(self, message=None, **kwargs):
        self.sent = kwargs.pop('sent', False)
        super().__init__(message, **kwargs)
        self.error_code = kwargs.get('error_code')


class ImageWorkerPrepareFailed(ImageWorkerError):
    """The worker answered a prepare command with an error completion."""

    _msg_fmt = _("Image worker of conductor %(host)s could not prepare "
                 "image %(image_href)s for node %(node)s: %(error_code)s: "
                 "%(reason)s")


class ImageWorkerTimeout(ImageWorkerError):
    """No completion arrived before the deadline."""

    _msg_fmt = _("Image worker of conductor %(host)s did not answer the "
                 "%(action)s command for node %(node)s within %(timeout)s "
                 "seconds (error_code %(error_code)s). Is "
                 "ironic-image-worker running on that host?")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'timeout')
        super().__init__(message, **kwargs)


class ImageWorkerNotListening(ImageWorkerError):
    """The broker could not route the command to any worker queue."""

    _msg_fmt = _("No image worker listens for conductor %(host)s: the "
                 "broker could not route %(routing_key)s on exchange "
                 "%(exchange)s (error_code %(error_code)s). Start "
                 "ironic-image-worker with [DEFAULT]host = %(host)s or set "
                 "[image_worker]conductor_host.")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'no_worker')
        super().__init__(message, **kwargs)


class ImageWorkerBrokerUnreachable(ImageWorkerError):
    """The broker of the worker could not be reached or refused us."""

    _msg_fmt = _("Cannot reach the image worker's broker for node "
                 "%(node)s (error_code %(error_code)s): %(reason)s")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'broker_unreachable')
        super().__init__(message, **kwargs)


class ImageWorkerNotConsuming(ImageWorkerNotListening):
    """The worker's queue exists but no worker has consumed it for a while.

    A stopped worker fails the deploy after
    [image_worker]worker_restart_grace instead of the whole
    prepare_timeout.
    """

    _msg_fmt = _("No image worker consumes queue %(queue)s of conductor "
                 "%(host)s for node %(node)s: it has had no consumer for "
                 "%(grace)s seconds (error_code %(error_code)s). Is "
                 "ironic-image-worker running on that host?")


class ImageWorkerUnreachable(ImageWorkerError):
    """The worker's JSON-RPC listener could not be reached."""

    _msg_fmt = _("Cannot reach the image worker's JSON-RPC listener at "
                 "%(url)s for node %(node)s (error_code %(error_code)s): "
                 "%(reason)s. Is ironic-image-worker running with "
                 "[json_rpc]listen there? Check "
                 "[image_worker_json_rpc]host_ip, port, use_ssl and cafile.")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'no_worker')
        super().__init__(message, **kwargs)


class ImageWorkerUnauthorized(ImageWorkerError):
    """The worker's JSON-RPC listener refused the credentials."""

    _msg_fmt = _("The image worker's JSON-RPC listener at %(url)s refused "
                 "the credentials for node %(node)s (error_code "
                 "%(error_code)s): set [image_worker_json_rpc]auth_strategy "
                 "= http_basic with username and password matching an "
                 "entry of the worker's [json_rpc]http_basic_auth_user_file.")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'unauthorized')
        super().__init__(message, **kwargs)


class ImageWorkerSealKeyError(ImageWorkerError):
    """[image_worker]seal_secret_file cannot be used: nothing was sent."""

    _msg_fmt = _("Cannot seal the command to the image worker for node "
                 "%(node)s (error_code %(error_code)s): %(reason)s. Fix "
                 "[image_worker]seal_secret_file and seal.")

    def __init__(self, message=None, **kwargs):
        kwargs.setdefault('error_code', 'seal_key')
        super().__init__(message, **kwargs)
