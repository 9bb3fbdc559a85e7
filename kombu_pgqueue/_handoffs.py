"""A handoff as its NOTIFY carries it: sealed by the publishing client, opened by the
consumer it is addressed to, and whether that consumer may still deliver it.

A publish to a queue a consumer waits for leases the message to that consumer and sends
it in the NOTIFY payload (statement ``publish``; docs/lifecycle.md, "Handoff"). Any role
that may connect may LISTEN on the channel, so the message travels sealed: AES-256-GCM
(the ``cryptography`` package) under the schema's key (table ``handoff_key``, migration
0010), which only roles granted the broker's tables may read. The publishing client
seals before it knows whether anybody waits (its statement picks the consumer), which
costs it a few microseconds; opening one costs the consumer as little, where fetching
the row by its id instead would cost a round trip (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
from collections import deque

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ._options import Options
from .records import Delivered, Handoff, Outgoing

logger = logging.getLogger(__name__)

#: PostgreSQL refuses a NOTIFY payload of 8000 bytes or more
NOTIFY_PAYLOAD_LIMIT = 8000

#: the most the rest of a handoff's payload takes: 'h:', the consumer's id (16), the
#: signature (32), the queue's token (16), the id, the lease, the lease end, and colons
HANDOFF_OVERHEAD = 2 + 16 + 32 + 16 + 3 * 24 + 6

#: AES-GCM's nonce and tag, in bytes
_NONCE = 12
_TAG = 16


def _clear(message: Outgoing) -> list[bytes]:
    """``message`` as a handoff seals it, but the body: ``<priority>:<lengths of content
    type, content encoding ('-': None), headers, properties>:``, then those four."""
    texts = (message.content_type, message.content_encoding, message.headers, message.properties)
    fields = [b"" if text is None else text.encode("utf-8") for text in texts]
    lengths = ["-" if text is None else str(len(field)) for text, field in zip(texts, fields)]
    head = f"{int(message.priority)}:{':'.join(lengths)}:".encode("ascii")
    return [head, *fields]


def _fits(clear: list[bytes], body: bytes) -> bool:
    """Whether a handoff of these parts, sealed (base64 of the nonce, the encrypted
    parts and the tag), fits a NOTIFY payload."""
    size = _NONCE + sum(map(len, clear)) + len(body) + _TAG
    return HANDOFF_OVERHEAD + 4 * -(-size // 3) < NOTIFY_PAYLOAD_LIMIT


def handoff_fits(message: Outgoing) -> bool:
    """Whether ``message``, sealed, fits a NOTIFY payload."""
    return _fits(_clear(message), message.body)


def seal(box: AESGCM, message: Outgoing, lease: int) -> str | None:
    """``message`` as a handoff carries it (its parts, see :func:`_clear`, and its body),
    encrypted under the schema's key with a random nonce, bound to ``lease`` (associated
    data), in base64; None when that would not fit a NOTIFY payload (checked before
    anything is encrypted or copied)."""
    clear = _clear(message)
    if not _fits(clear, message.body):
        return None
    nonce = os.urandom(_NONCE)
    plain = b"".join([*clear, message.body])
    return base64.b64encode(nonce + box.encrypt(nonce, plain, str(lease).encode())).decode()


def signature(secret: str, message: str) -> str:
    """How statement publish signs a handoff's ``message`` for the consumer that has
    ``secret``: sha256(secret || message || secret), its first 32 hex digits."""
    signed = (secret + message + secret).encode("utf-8")
    return hashlib.sha256(signed).hexdigest()[:32]


def parse_handoff(rest: str, secret: str, box: AESGCM | None) -> Handoff | None:
    """A handoff's payload after ``h:<consumer>:`` (as statement publish writes it):
    ``<signature>:<token>:<id>:<lease>:<lease end>:<sealed message>``; None if
    malformed, not signed with ``secret`` (any role that may connect may NOTIFY, and
    may read a handoff meant for another consumer), or not sealed with the key of
    ``box``."""
    sent, _, rest = rest.partition(":")
    if box is None or not secret or not hmac.compare_digest(sent, signature(secret, rest)):
        return None
    parts = rest.split(":", 4)
    if len(parts) != 5:
        return None
    token, id_, lease, until, sealed = parts
    try:
        raw = base64.b64decode(sealed, validate=True)
        plain = box.decrypt(raw[:_NONCE], raw[_NONCE:], lease.encode())
        *head, data = plain.split(b":", 5)
        if len(head) != 5:
            return None
        priority = int(head[0])
        sizes = [-1 if n == b"-" else int(n) for n in head[1:]]
        texts: list[str | None] = []
        at = 0
        for size in sizes:
            texts.append(None if size < 0 else data[at : at + size].decode("utf-8"))
            at += max(size, 0)
        row = Delivered(
            int(id_), priority, 1, data[at:], texts[0], texts[1], texts[2] or "", texts[3] or ""
        )
        return Handoff(token, int(lease), float(until), row)
    except (ValueError, binascii.Error, InvalidTag):
        return None


def late(handoff: Handoff, options: Options, now: float) -> bool:
    """Whether ``handoff`` was read too late to deliver (at ``now``, epoch seconds).

    Its lease is the consumer's ``visibility_timeout``; if less of it is left than a
    claimed message has at its first renewal, the consumer did not read its LISTEN
    socket for longer than ``renewal_interval`` (an event loop blocked by a task, as in
    Celery's solo pool), or the clocks of this host and the database differ by as much.
    Delivered now, its lease could end before the lease keeper renews it, and another
    consumer would then run it too: it is handed back instead.
    """
    left = handoff.until - now
    if left >= options.visibility_timeout - options.renewal_interval:
        return False
    logger.warning(
        "pgqueue: message %s was handed off to this consumer with %.1f s of its lease left "
        "(a blocked event loop, or this host's clock is off the database's): handed back",
        handoff.row.id,
        left,
    )
    return True


class Replays:
    """The handoffs a consumer took, until their leases end: any role that may connect
    reads a handoff on the channel and may NOTIFY it again, signed and sealed as it is;
    delivered twice, its task would run twice. A replay read after the lease ended is
    refused by :func:`late` (and cannot be acked); one before is refused here."""

    def __init__(self) -> None:
        self._taken: set[tuple[int, int]] = set()
        #: (lease end, (id, lease)), in the order taken: lease ends grow with it
        self._ends: deque[tuple[float, tuple[int, int]]] = deque()

    def first(self, handoff: Handoff, now: float) -> bool:
        """Whether ``handoff`` (read at ``now``, epoch seconds) was not taken before;
        from now on it was."""
        while self._ends and self._ends[0][0] < now:
            self._taken.discard(self._ends.popleft()[1])
        key = (handoff.row.id, handoff.lease)
        if key in self._taken:
            logger.warning(
                "pgqueue: ignoring message %s handed off again with the same lease (a "
                "notification replayed by a role that may connect)",
                handoff.row.id,
            )
            return False
        self._taken.add(key)
        self._ends.append((handoff.until, key))
        return True
