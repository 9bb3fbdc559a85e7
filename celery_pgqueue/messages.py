"""Celery task messages built without publishing them, for bulk paths.

:func:`task_message` returns exactly what ``apply_async`` would hand to Kombu
(protocol 2: headers, properties, serialized body), so an unmodified worker runs
it. Bulk enqueue and the Spark pipeline write such messages many at a time.
"""

from __future__ import annotations

import json as std_json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import uuid4

from celery import Celery
from celery.utils import uuid
from celery.utils.functional import maybe_list

from kombu_pgqueue.codec import task_dedup_key
from kombu_pgqueue.records import Outgoing

from ._kombu import json_dumps, serialize

_PASSED = (
    "chain",
    "chord",
    "group_id",
    "group_index",
    "parent_id",
    "shadow",
    "time_limit",
    "soft_time_limit",
    "ignore_result",
    "stamped_headers",
)


@dataclass(frozen=True, slots=True)
class TaskMessage:
    queue: str
    message: dict[str, Any]
    task_id: str


def task_message(
    app: Celery,
    name: str,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    task_id: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    eta: datetime | None = None,
    countdown: float | None = None,
    expires: float | datetime | None = None,
    dedup_key: str | None = None,
    headers: dict[str, Any] | None = None,
    **options: Any,
) -> TaskMessage:
    """Build the Kombu message ``app.send_task(name, args, kwargs, ...)`` would publish."""
    task_id = task_id or uuid()
    kwargs = kwargs or {}
    route_options: dict[str, Any] = {}
    if queue:
        route_options["queue"] = queue
    if priority is not None:
        route_options["priority"] = priority
    routed = app.amqp.router.route(route_options, name, args, kwargs, task_type=app.tasks.get(name))
    target = routed.get("queue")
    queue_name = target if isinstance(target, str) else target.name
    if priority is None:
        priority = routed.get("priority", app.conf.task_default_priority)
    expires_s: float | None = None
    if isinstance(expires, datetime):
        expires_s = (expires - app.now()).total_seconds()
    elif expires is not None:
        expires_s = float(expires)
        expires = app.now() + timedelta(seconds=expires_s)
    # the rest of apply_async's options, under as_task_v2's names
    extra = {k: options[k] for k in _PASSED if options.get(k) is not None}
    if options.get("link"):
        extra["callbacks"] = maybe_list(options["link"])
    if options.get("link_error"):
        extra["errbacks"] = maybe_list(options["link_error"])
    task_headers, properties, body, _ = app.amqp.as_task_v2(
        task_id,
        name,
        list(args),
        kwargs,
        countdown=countdown,
        eta=eta,
        expires=expires,
        root_id=options.get("root_id") or task_id,
        reply_to=options.get("reply_to") or app.thread_oid,
        origin="pgqueue-bulk",
        **extra,
    )
    if headers:
        task_headers.update(headers)
    content_type, content_encoding, payload = serialize(body, serializer=app.conf.task_serializer)
    properties.update(delivery_mode=2, priority=priority or 0, delivery_info={})
    if expires_s is not None:
        properties["expiration"] = str(int(max(expires_s, 0) * 1000))
    if dedup_key is not None:
        properties["dedup_key"] = dedup_key
    message = {
        "body": payload,
        "content-type": content_type,
        "content-encoding": content_encoding,
        "headers": task_headers,
        "properties": properties,
    }
    return TaskMessage(queue_name, message, task_id)


_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _json(value: Any) -> str:
    try:
        return std_json.dumps(value)
    except (TypeError, ValueError):
        return json_dumps(value)  # datetimes, UUIDs, Decimals as Kombu encodes them


class TaskMessageFactory:
    """Many messages for one task and queue, fast: the headers are built once.

    Produces what :func:`task_message` produces for the same arguments (and so what
    ``apply_async`` publishes), for the JSON serializer.
    """

    def __init__(
        self,
        app: Celery,
        name: str,
        *,
        queue: str | None = None,
        priority: int | None = None,
        dedup_task_ids: bool = True,
    ) -> None:
        template = task_message(app, name, (), {}, task_id="-", queue=queue, priority=priority)
        if template.message["content-type"] != "application/json":
            raise ValueError(
                f"TaskMessageFactory writes JSON; the app's task_serializer is "
                f"{app.conf.task_serializer!r}"
            )
        self.queue = template.queue
        self.name = name
        self.priority = int(template.message["properties"]["priority"])
        self.dedup_task_ids = dedup_task_ids
        self._headers = template.message["headers"]
        self._properties = {
            k: v for k, v in template.message["properties"].items() if k != "dedup_key"
        }
        self._properties["delivery_info"] = {"exchange": "", "routing_key": self.queue}
        self._maxlen = app.amqp.argsrepr_maxsize

    def outgoing(
        self,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        task_id: str | None = None,
        eta: datetime | None = None,
        expires: datetime | None = None,
        dedup_key: str | None = None,
    ) -> Outgoing:
        task_id = task_id or str(uuid4())
        kwargs = kwargs or {}
        args = list(args)
        headers = dict(
            self._headers,
            id=task_id,
            root_id=task_id,
            argsrepr=repr(tuple(args))[: self._maxlen],  # as delay() shows its tuple
            kwargsrepr=repr(kwargs)[: self._maxlen],
            eta=eta.isoformat() if eta else None,
            expires=expires.isoformat() if expires else None,
        )
        properties = dict(self._properties, correlation_id=task_id)
        expires_at = None
        if expires is not None:
            expires_at = expires
            remaining = (expires - datetime.now(expires.tzinfo)).total_seconds()
            properties["expiration"] = str(int(max(remaining, 0) * 1000))
        if dedup_key is not None:
            properties["dedup_key"] = dedup_key
        elif self.dedup_task_ids:
            dedup_key = task_dedup_key(task_id)
        return Outgoing(
            queue=self.queue,
            body=_json([args, kwargs, _EMBED]).encode(),
            headers=_json(headers),
            properties=_json(properties),
            content_type="application/json",
            content_encoding="utf-8",
            priority=self.priority,
            eta=eta,
            expires_at=expires_at,
            dedup_key=dedup_key,
        )
