"""Task messages from fixed text: what TaskMessageFactory writes, at a fraction of the cost.

Bulk sends (:mod:`celery_pgqueue.bulk`) and Spark partitions (:mod:`celery_pgqueue.spark`)
write many messages for one task; the JSON around the parts that vary per message is
made once, from the factory's own output, and checked against it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any

from kombu_pgqueue.codec import task_dedup_key
from kombu_pgqueue.records import Outgoing

from ._kombu import json_dumps
from .messages import TaskMessageFactory

if TYPE_CHECKING:
    from celery import Celery


_encode = json.JSONEncoder().encode  # what json.dumps does with no arguments


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps's own C encoder, made once: what json.dumps(value) writes, at half the cost
# (no circular-reference check: a cycle ends in RecursionError, which is a ValueError
# subclass no more than json.dumps would catch; arguments that are rows hold none)
_c_encode = (
    c_make_encoder(None, _refuse, encode_basestring_ascii, None, ": ", ", ", False, False, True)
    if c_make_encoder is not None
    else None
)


def json_text(value: Any) -> str:
    # as messages.TaskMessageFactory encodes: plain json, else Kombu's types
    try:
        if _c_encode is not None:
            return "".join(_c_encode(value, 0))
        return _encode(value)
    except (TypeError, ValueError):
        return json_dumps(value)


_HEADER_SLOTS = ("id", "root_id", "argsrepr", "kwargsrepr", "eta", "expires")
_PROPERTY_SLOTS = ("correlation_id", "priority", "expiration", "dedup_key")


def _split(text: str, slots: Sequence[str], required: int) -> str:
    """Turn a factory-written JSON object into a ``str.format`` template.

    The value of ``slots[i]`` becomes ``{i}`` wherever the factory put that key; a slot
    the factory did not write stays out. The first ``required`` slots must be there.
    """
    found = json.loads(text)
    if _encode(found) != text:
        raise ValueError(f"the factory's JSON is not plain json.dumps output: {text[:200]}")
    marks = {}
    for position, name in enumerate(slots):
        if name in found:
            marks[position] = found[name] = f"\x00pgq:{name}\x00"
        elif position < required:
            raise ValueError(f"the factory's message has no {name!r}: {text[:200]}")
    template = _encode(found).replace("{", "{{").replace("}", "}}")
    for position, mark in marks.items():
        template = template.replace(_encode(mark), f"{{{position}}}")
    return template


class MessageTemplate:
    """Messages for one task, from fixed text around the parts that vary per row.

    Built from :class:`~celery_pgqueue.messages.TaskMessageFactory` output and checked
    against the factory when made, so it writes what the factory (and ``apply_async``)
    writes, at a fraction of the cost; it carries only strings, so Spark executors need
    no Celery app. ``message()`` returns a staging row (see ``kombu_pgqueue.admin.load_staged``).
    """

    def __init__(
        self, app: Celery, task: str, *, queue: str | None, priority: int | None, keyed: bool
    ) -> None:
        factory = TaskMessageFactory(app, task, queue=queue, priority=priority)
        self.task = task
        self.queue = factory.queue
        self.priority = factory.priority
        self.keyed = keyed
        self.maxlen = int(app.amqp.argsrepr_maxsize)
        key = "k" if keyed else None
        probe = factory.outgoing([], {}, task_id="probe", dedup_key=key)
        self.embed = json.loads(probe.body)[2]
        self.headers = _split(probe.headers, _HEADER_SLOTS, len(_HEADER_SLOTS))
        self.properties = _split(probe.properties, _PROPERTY_SLOTS, 2)
        past = datetime(2000, 1, 1, tzinfo=timezone.utc)
        probe = factory.outgoing([], {}, task_id="probe", expires=past, dedup_key=key)
        self.expiring_properties = _split(probe.properties, _PROPERTY_SLOTS, 2)
        self._check(factory, app)

    def body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return json_text([args, kwargs, self.embed])

    def message(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: str,
        task_id: str,
        dedup_key: str | None,
        priority: int,
        eta: datetime | None,
        expires: datetime | None,
    ) -> tuple[Any, ...]:
        """One COPY row of the staging table (the fields of an Outgoing, in COPY order)."""
        quoted = '"' + task_id + '"'
        maxlen = self.maxlen
        headers = self.headers.format(
            quoted,
            quoted,
            encode_basestring_ascii(repr(args)[:maxlen]),
            encode_basestring_ascii(repr(kwargs)[:maxlen]),
            '"' + eta.isoformat() + '"' if eta else "null",
            '"' + expires.isoformat() + '"' if expires else "null",
        )
        quoted_key = "null" if dedup_key is None else encode_basestring_ascii(dedup_key)
        if expires is None:
            properties = self.properties.format(quoted, priority, None, quoted_key)
        else:
            remaining = (expires - datetime.now(expires.tzinfo)).total_seconds()
            expiration = '"' + str(int(max(remaining, 0) * 1000)) + '"'
            properties = self.expiring_properties.format(quoted, priority, expiration, quoted_key)
        if not self.keyed:
            dedup_key = task_dedup_key(task_id)
        return (
            self.queue,
            priority,
            eta,
            expires,
            dedup_key,
            body.encode(),
            "application/json",
            "utf-8",
            headers,
            properties,
        )

    @staticmethod
    def outgoing(row: tuple[Any, ...]) -> Outgoing:
        keys: tuple[str, ...] = ("queue", "priority", "eta", "expires_at", "dedup_key", "body")
        keys += ("content_type", "content_encoding", "headers", "properties")
        return Outgoing(**dict(zip(keys, row)))

    def _check(self, factory: Any, app: Celery) -> None:
        eta = datetime(2030, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc)
        past = datetime(2001, 1, 1, tzinfo=timezone.utc)
        args: tuple[Any, ...] = ("https://example.com/a b", 1, 2.5, None, True, "\u00e9\x00")
        kwargs = {"n": 3, "tag": "x"}
        key = "k:1" if self.keyed else None
        for priority in (self.priority, 7):
            made = factory
            if priority != self.priority:
                made = TaskMessageFactory(app, self.task, queue=self.queue, priority=priority)
            for expires in (None, past):
                want = made.outgoing(
                    args, kwargs, task_id="id-1", eta=eta, expires=expires, dedup_key=key
                )
                body = self.body(args, kwargs)
                got = self.message(args, kwargs, body, "id-1", key, priority, eta, expires)
                if self.outgoing(got) != want:
                    raise RuntimeError(
                        "the message template builds messages that differ from "
                        f"TaskMessageFactory's:\n{self.outgoing(got)}\n{want}"
                    )
