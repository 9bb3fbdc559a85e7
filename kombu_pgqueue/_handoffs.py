"""A handoff as its NOTIFY carries it, and whether a consumer may still deliver it.

A publish to a queue a consumer waits for leases the message to that consumer and sends
it in the NOTIFY payload (statement ``publish``; docs/lifecycle.md, "Handoff").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging

from ._options import Options
from .records import Delivered, Handoff

logger = logging.getLogger(__name__)


def signature(secret: str, message: str) -> str:
    """How statement publish signs a handoff's ``message`` for the consumer that has
    ``secret``: sha256(secret || message || secret), its first 32 hex digits."""
    signed = (secret + message + secret).encode("utf-8")
    return hashlib.sha256(signed).hexdigest()[:32]


def parse_handoff(rest: str, secret: str) -> Handoff | None:
    """A handoff's payload after ``h:<consumer>:`` (as statement publish writes it):
    ``<signature>:<token>:<id>:<lease>:<lease end>:<priority>:<lengths of content type,
    content encoding ('-': None), headers, properties>:<those four><body in base64>``;
    None if malformed or not signed with ``secret`` (a forgery: any role that may connect
    may NOTIFY)."""
    sent, _, rest = rest.partition(":")
    if not secret or not hmac.compare_digest(sent, signature(secret, rest)):
        return None
    parts = rest.split(":", 9)
    if len(parts) != 10:
        return None
    token, id_, lease, until, priority, *lengths, data = parts
    try:
        sizes = [-1 if n == "-" else int(n) for n in lengths]
        texts: list[str | None] = []
        at = 0
        for size in sizes:
            texts.append(None if size < 0 else data[at : at + max(size, 0)])
            at += max(size, 0)
        body = base64.b64decode(data[at:], validate=True)
        row = Delivered(
            int(id_), int(priority), 1, body, texts[0], texts[1], texts[2] or "", texts[3] or ""
        )
        return Handoff(token, int(lease), float(until), row)
    except (ValueError, binascii.Error):
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
