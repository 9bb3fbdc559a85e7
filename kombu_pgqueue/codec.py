"""Kombu's message dicts to rows and back, delivery tags and dedup keys.

Pure functions, no database: a Kombu message (``{"body", "headers", "properties",
"content-type", "content-encoding"}``) becomes an :class:`~kombu_pgqueue.records.Outgoing`
on the way in, and a :class:`~kombu_pgqueue.records.Delivered` row becomes Kombu's
payload on the way out, with a delivery tag ``"<id>.<lease>"`` that ack, reject and
lease renewal parse back.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from kombu.utils.json import dumps, loads

from ._options import check_name
from .exceptions import MessageError
from .records import Delivery, Outgoing

logger = logging.getLogger(__name__)

#: the message property that names one publish call (see :func:`publish_dedup_key`);
#: never stored: a delivery that is published again is a new call
PUBLISH_ID = "pgqueue_publish_id"

#: how a Celery task message without a dedup key of its own is keyed:
#: "publish": by its task id and publish call (Kombu's retries of that call are dropped)
#: "task": by its task id alone (bulk sends and Spark: a send that runs again queues
#: nothing still waiting or running); None: not at all
TaskKeys = Literal["publish", "task"] | None


def publish_dedup_key(task_id: str, publish_id: str) -> str:
    """The dedup key of one publish call of a Celery task message.

    Kombu's retries of that call carry the same ``publish_id``; any other publish of
    the task id (``Task.replace``, ``Task.retry``, a chord body, the same
    ``apply_async(task_id=...)`` sent again) has another and is queued.
    """
    return f"celery:{task_id}:{publish_id}"


def task_dedup_key(task_id: str, retries: int | None = 0) -> str:
    """The dedup key of a task message sent in bulk (``celery_pgqueue.bulk``, Spark).

    The task id (and retry count): a bulk send or Spark partition that runs again
    sends the same ids, and queues nothing that is still waiting or running.
    """
    return f"celery:{task_id}:{retries or 0}"


def delivery_tag(message_id: int, lease: int) -> str:
    return f"{message_id}.{lease}"


def parse_tag(tag: str) -> tuple[int, int]:
    """(message id, lease) of a delivery tag; lease 0 for a message taken without ack."""
    message_id, _, lease = str(tag).partition(".")
    return int(message_id), int(lease or 0)


def stamp(message: dict[str, Any], exchange: str, routing_key: str) -> dict[str, Any]:
    """Record where ``message`` was published, as Kombu's channels do before sending."""
    properties = message.setdefault("properties", {})
    properties.setdefault("delivery_info", {}).update(exchange=exchange, routing_key=routing_key)
    return message


#: the most a message (body, headers and properties) may take. PostgreSQL builds no value
#: of 1 GiB or more, and a statement that reads a body in text format (a claim without a
#: pool's binary results, ``basic_get``, ``celery pgqueue dead show``, a text COPY)
#: gets it as hex, twice its size: so half of that, less a megabyte for the rest. A
#: larger body published, but no consumer could read it back
MAX_MESSAGE_BYTES = (1 << 29) - (1 << 20)


def outgoing(queue: str, message: Mapping[str, Any], *, task_keys: TaskKeys) -> Outgoing:
    """The row of a Kombu message for ``queue`` ("" when routed by an exchange)."""
    body = message.get("body")
    if body is None:
        body = b""
    elif isinstance(body, str):
        body = body.encode("utf-8")
    elif not isinstance(body, (bytes, bytearray, memoryview)):
        raise MessageError(f"message body must be str or bytes, got {type(body).__name__}")
    headers = message.get("headers") or {}
    properties = message.get("properties") or {}
    key = dedup_key(headers, properties, task_keys)
    # the call's id stays in the caller's dict (a retry of the call finds it there) but
    # out of the stored row: a delivery published again is a new call
    publish_id = properties.pop(PUBLISH_ID, None)
    try:
        properties_json = _properties_json(queue, properties)
    finally:
        if publish_id is not None:
            properties[PUBLISH_ID] = publish_id
    try:
        # NaN and Infinity are not JSON; PostgreSQL would refuse them later
        headers_json = dumps(headers, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise MessageError(
            f"message for queue {queue!r} has headers that cannot be stored as JSON: {exc}"
        ) from exc
    size = len(body) + len(headers_json) + len(properties_json)
    if size > MAX_MESSAGE_BYTES:
        raise MessageError(
            f"message for {('queue ' + repr(queue)) if queue else 'an exchange'} takes "
            f"{size / (1 << 20):,.0f} MiB (body, headers and properties), over the "
            f"{MAX_MESSAGE_BYTES >> 20:,} MiB that PostgreSQL can hand back to a consumer: keep "
            "the payload elsewhere (a table, object storage) and send a reference to it"
        )
    return Outgoing(
        queue=queue,
        body=bytes(body),
        headers=headers_json,
        properties=properties_json,
        content_type=message.get("content-type"),
        content_encoding=message.get("content-encoding"),
        priority=_priority(properties),
        eta=parse_eta(headers.get("eta")),
        expires_at=ms_from_now(properties.get("expiration")),
        dedup_key=key,
    )


def _properties_json(queue: str, properties: Mapping[str, Any]) -> str:
    """The properties as JSON text, without those JSON cannot hold.

    An AMQP broker keeps only the properties AMQP defines and drops any other keyword
    given to ``Producer.publish`` (Celery's own signal handlers pass some through, such
    as the ``signal`` object of ``before_task_publish``). Such a property that JSON
    cannot hold is dropped here too, with a warning, rather than the message.
    """
    try:
        return str(dumps(properties, allow_nan=False))
    except (TypeError, ValueError):
        pass
    kept: dict[str, Any] = {}
    for key, value in properties.items():
        try:
            dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            logger.warning(
                "pgqueue: dropped message property %r for queue %r: %s cannot be stored as "
                "JSON (AMQP brokers drop properties they do not define, too)",
                key,
                queue,
                type(value).__name__,
            )
            continue
        kept[key] = value
    return str(dumps(kept, allow_nan=False))


def dedup_key(headers: Mapping[str, Any], properties: Any, task_keys: TaskKeys) -> str | None:
    """The message's dedup key: its own, else by ``task_keys`` for a Celery task."""
    key = properties.get("dedup_key") or headers.get("dedup_key")
    if key is not None:
        return check_name("dedup key", str(key))
    task_id = headers.get("id")
    if task_keys is None or not headers.get("task") or not task_id:
        return None
    if task_keys == "task":
        return task_dedup_key(str(task_id), headers.get("retries"))
    # Kombu retries a publish (Producer.publish(retry=True), Celery's default) by
    # preparing the message again from the same properties dict: the id set here on
    # the first attempt comes back on every retry of that call, so a retry whose first
    # commit reached the server is not queued twice. A new call (Task.replace, a chord
    # body, apply_async(task_id=...) sent again) has a new dict, so a new id: Celery
    # meant to send it, and it is queued.
    publish_id = properties.setdefault(PUBLISH_ID, uuid.uuid4().hex)
    return publish_dedup_key(str(task_id), str(publish_id))


def payload(delivery: Delivery) -> dict[str, Any]:
    """Kombu's payload of a delivery, tagged for ack by its lease."""
    row = delivery.row
    properties = _loads(row.properties)
    properties["delivery_tag"] = delivery_tag(row.id, delivery.lease)
    properties.pop("expiration", None)
    delivery_info = properties.setdefault("delivery_info", {})
    delivery_info.update(
        redelivered=row.attempts > 1,
        pgqueue_id=row.id,
        pgqueue_queue=delivery.queue,
        pgqueue_attempts=row.attempts,
    )
    if delivery.handoff:
        delivery_info["pgqueue_handoff"] = True
    return {
        "body": bytes(row.body),
        "content-type": row.content_type,
        "content-encoding": row.content_encoding,
        "headers": _loads(row.headers),
        "properties": properties,
    }


def parse_eta(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        eta = value
    else:
        try:
            eta = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            logger.warning("pgqueue: ignoring unparseable eta header %r", value)
            return None
    return eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)


def ms_from_now(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    try:
        return datetime.now(timezone.utc) + timedelta(milliseconds=float(value))
    except (TypeError, ValueError, OverflowError):
        raise MessageError(f"message expiration must be milliseconds, got {value!r}") from None


def seconds(ms: Any) -> float | None:
    return None if ms is None else float(ms) / 1000.0


def _priority(properties: Mapping[str, Any]) -> int:
    """Kombu's priority property as a stored priority (0-255, higher first)."""
    try:
        return max(0, min(int(properties["priority"]), 255))
    except (TypeError, ValueError, KeyError):
        return 0  # as Kombu's channels take it


def _loads(text: str) -> Any:
    """Kombu's JSON ``loads``, without its per-object hook where no object can need it.

    Kombu's hook only turns objects whose keys are ``__type__`` and ``__value__`` back
    into datetimes, UUIDs and the like; a key can only be spelled that way, or with a
    ``\\u`` escape. Without either in the text, the standard library's decoder gives the
    same result and builds no decoder and calls no Python function per object: headers
    and properties are decoded for every message a worker receives.
    """
    if "__type__" in text or "\\u" in text:
        return loads(text)
    return json.loads(text)
