"""Task ids and dedup keys for rows; the messages come from celery_pgqueue._template."""

from __future__ import annotations

from hashlib import sha1
from uuid import NAMESPACE_URL, uuid5

from .._template import MessageTemplate as _Template
from .._template import json_text as _json

NAMESPACE = uuid5(NAMESPACE_URL, "pgqueue:spark")
MAX_KEY_BYTES = 2000  # a dedup-key index entry must fit a third of a page


# -- JSON and ids, as the factory writes them -------------------------------------------


_NAMESPACE_BYTES = NAMESPACE.bytes
_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # RFC 4122 variant bits


def _uuid5(name: str) -> str:
    """``str(uuid5(NAMESPACE, name))``, at a third of the cost."""
    h = sha1(_NAMESPACE_BYTES + name.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


__all__ = ["MAX_KEY_BYTES", "NAMESPACE", "_Template", "_json", "_uuid5"]
