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

"""The seal on commands sent to the image worker and on its answers.

Anyone on a shared broker can publish to the worker's command exchange and
to this interface's reply queues. With ``[image_worker]seal_secret_file``
(the secret the worker's ``[amqp]seal_secret_file`` holds too), every
command carries an HMAC-SHA256 over what it is, where it goes and when it
was sealed, and only an answer sealed for this very request is taken.

This is the wire form of docs/contract.md, "Sealed commands and answers",
written from that text (version 1): the header ``x-iiw-seal`` holds
``1:<key id>:<sealed_at>:<valid_ms>:<mac>``; the MAC is HMAC-SHA256 over
the tag ``ironic-image-worker seal v1\\n`` then the fields kind, key id,
routing key, reply_to, correlation_id, sealed_at, valid_ms and body, each
written as ``\\x00`` when absent, else ``\\x01``, its length as an 8-byte
big-endian integer, and its bytes.
"""

import hashlib
import hmac
import os
import stat
import struct

HEADER = 'x-iiw-seal'

_TAG = b'ironic-image-worker seal v1\n'
_KEY_ID_TAG = b'ironic-image-worker seal key v1\n'

# Shortest key, in bytes.
MIN_KEY_BYTES = 32

# The seal modes of [image_worker]seal.
OFF = 'off'
SEND = 'send'
REQUIRE = 'require'

# Why an answer's seal was not taken.
UNSEALED = 'unsealed'
BAD_SEAL = 'bad_seal'


class KeyFileError(Exception):
    """The seal key file cannot be used (said why)."""


def key_id(key):
    """The id a seal names ``key`` by: 16 hex digits of SHA-256 over the
    key-id tag and the key."""
    return hashlib.sha256(_KEY_ID_TAG + key).hexdigest()[:16]


def parse_keys(text):
    """The keys of a key file's text: one hex key a line (at least 32
    bytes), current first, at most one previous; blank lines and ``#``
    comments skipped.

    :raises: KeyFileError
    """
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith('#'):
            continue
        try:
            key = bytes.fromhex(line)
        except ValueError:
            raise KeyFileError('line %d: not a hex key' % number)
        if len(key) < MIN_KEY_BYTES:
            raise KeyFileError('line %d: a key of %d bytes, at least %d are '
                               'needed (64 hex digits)'
                               % (number, len(key), MIN_KEY_BYTES))
        keys.append(key)
    if not keys:
        raise KeyFileError('no key in it')
    if len(keys) > 2:
        raise KeyFileError('%d keys: one (current) or two (current, then '
                           'previous)' % len(keys))
    return keys


def read_keys(path):
    """The keys of the key file at ``path``, refused when others may read
    it or its group change it (mode 0600 or 0640).

    :raises: KeyFileError
    """
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o027:
            raise KeyFileError('%s: mode %04o lets others read it or its '
                               'group change it: chmod 0600 (or 0640)'
                               % (path, mode))
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise KeyFileError('%s: %s' % (path, e))
    try:
        return parse_keys(text)
    except KeyFileError as e:
        raise KeyFileError('%s: %s' % (path, e))


def _field(value):
    if value is None:
        return b'\x00'
    if isinstance(value, str):
        value = value.encode('utf-8')
    return b'\x01' + struct.pack('>Q', len(value)) + value


def _mac(key, kind, routing_key, reply_to, correlation_id, sealed_at,
         valid_ms, body):
    message = b''.join(
        [_TAG] + [_field(v) for v in (kind, key_id(key), routing_key,
                                      reply_to, correlation_id,
                                      str(sealed_at), str(valid_ms), body)])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def seal(keys, kind, routing_key, reply_to, correlation_id, body, sealed_at,
         valid_ms):
    """The header value sealing ``body`` (bytes) with the current key."""
    key = keys[0]
    mac = _mac(key, kind, routing_key, reply_to, correlation_id, sealed_at,
               valid_ms, body)
    return '1:%s:%d:%d:%s' % (key_id(key), sealed_at, valid_ms, mac)


def _number(text):
    if not text.isdigit() or str(int(text)) != text:
        raise ValueError(text)
    return int(text)


def check(keys, header, kind, routing_key, reply_to, correlation_id, body):
    """Why the seal ``header`` of ``body`` does not hold for this message
    (``UNSEALED``, ``BAD_SEAL``), or None when it does: made with one of
    ``keys`` over this very message. Answers are bound to their request
    (its reply queue and correlation id), not to a time window."""
    if header is None:
        return UNSEALED
    if isinstance(header, bytes):
        header = header.decode('utf-8', 'replace')
    parts = str(header).split(':')
    if len(parts) != 5 or parts[0] != '1':
        return BAD_SEAL
    try:
        sealed_at, valid_ms = _number(parts[2]), _number(parts[3])
    except ValueError:
        return BAD_SEAL
    for key in keys:
        if key_id(key) != parts[1]:
            continue
        want = _mac(key, kind, routing_key, reply_to, correlation_id,
                    sealed_at, valid_ms, body)
        if hmac.compare_digest(want, parts[4]):
            return None
    return BAD_SEAL


class Policy(object):
    """The seal policy of ``[image_worker]``: the keys, and whether
    commands are sealed and unsealed answers refused."""

    def __init__(self, keys, mode):
        self.keys = keys
        self.mode = mode

    @classmethod
    def from_conf(cls, group):
        """The policy ``[image_worker]seal_secret_file`` and ``seal`` give
        (``seal`` unset: ``require`` with a key file, else ``off``).

        :raises: KeyFileError
        """
        path = group.seal_secret_file
        mode = group.seal or (REQUIRE if path else OFF)
        if mode == OFF:
            return cls(None, OFF)
        if not path:
            raise KeyFileError('[image_worker]seal = %s needs '
                               '[image_worker]seal_secret_file' % mode)
        return cls(read_keys(path), mode)

    @property
    def sealing(self):
        return self.mode != OFF

    def refusal(self, header, routing_key, correlation_id, body):
        """Why an answer published to ``routing_key`` (the reply queue)
        with ``correlation_id`` is not taken, or None. ``send`` takes an
        unsealed answer; a seal that does not hold is refused in any mode
        that seals."""
        if not self.sealing:
            return None
        why = check(self.keys, header, 'answer', routing_key, None,
                    correlation_id, body)
        if why == UNSEALED and self.mode == SEND:
            return None
        return why
