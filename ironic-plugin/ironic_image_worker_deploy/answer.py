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

"""Which completion is the worker's answer to a request."""

from urllib import parse as urlparse

from oslo_log import log

LOG = log.getLogger(__name__)

# How much of a value a warning shows (a message may carry anything).
_SHOWN = 120


def is_answer(done, action, node_uuid, request_id, source_url=None):
    """Whether ``done`` is the worker's answer to this very request.

    A reply queue is named after its request and a ``correlation_id`` is
    the request id: anyone on the broker who saw the command (or read the
    request id in Ironic's notifications, ``driver_internal_info``) can
    publish to it. So a completion counts only when its ``action``,
    ``node_uuid`` and ``request_id`` are the request's (a genuine answer
    captured for another node or request is no answer to this one) and,
    for a successful ``prepare``, its ``image_url`` is what the worker
    answers: ``source_url`` itself when the worker passes the source
    through (``deploy.passed_through``), else an http(s) URL of this node
    (``<http_url>/<http_image_subdir>/<node>``). Its host cannot be checked
    here: the worker's ``http_url`` need not be Ironic's (an HTTPS image
    port overrides it); only an authenticated answer would tell.

    A message that is not the answer is logged and skipped; the caller
    waits on for the genuine one, within its own deadline. It never fails
    the wait: that would let anyone on the broker fail deploys.

    :param done: the decoded message (anything; a completion is a dict).
    :returns: True when it is the answer; False, logged at warning with
        what did not match (no checksum, no URL credentials), when not.
    """
    why = _mismatch(done, action, node_uuid, request_id, source_url)
    if why is None:
        return True
    LOG.warning('Ignoring a message that is not the image worker\'s answer '
                'to %(action)s request %(req)s of node %(node)s: %(why)s; '
                'still waiting for the answer',
                {'action': action, 'req': request_id, 'node': node_uuid,
                 'why': why})
    return False


def _mismatch(done, action, node_uuid, request_id, source_url):
    """What makes ``done`` not the answer, or None."""
    if not isinstance(done, dict):
        return 'it is not a JSON object'
    for field, wanted in (('action', action), ('node_uuid', node_uuid),
                          ('request_id', request_id)):
        if done.get(field) != wanted:
            return '%s is %s, not %s' % (field, _shown(done.get(field)),
                                         wanted)
    if action != 'prepare' or done.get('status') != 'success':
        return None
    got = done.get('image_url')
    if source_url is not None:
        if got != source_url:
            return ('image_url is %s, not the source the worker passes '
                    'through' % _shown_url(got))
        return None
    try:
        parts = urlparse.urlsplit(got) if isinstance(got, str) else None
    except ValueError:
        parts = None
    if (parts is None or parts.scheme not in ('http', 'https')
            or not parts.path.endswith('/' + node_uuid)):
        return ('image_url %s is not an http(s) URL of node %s'
                % (_shown_url(got), node_uuid))
    return None


def _shown(value):
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + '...'


def _shown_url(url):
    """A URL for a log: no user-info, query or fragment (credentials)."""
    if not isinstance(url, str):
        return _shown(url)
    try:
        parts = urlparse.urlsplit(url)
    except ValueError:
        return '<an unreadable URL>'
    masked = urlparse.urlunsplit(
        (parts.scheme, parts.netloc.rpartition('@')[2], parts.path,
         '***' if parts.query else '', '***' if parts.fragment else ''))
    return _shown(masked)
