"""Failed tasks kept in the broker: on with ``configure()``, for 7 days.

A task that raised after its last retry leaves no trace in a Celery broker: its message
was acked, before it ran (the default) or after it failed (``acks_late``). With the
Celery setting ``pgqueue_keep_failed = True`` (what :func:`celery_pgqueue.configure`
sets unless told ``keep_failed=False`` or the setting is already there), such a task
stays in the dead-letter table with reason ``failed``: its message (task name, id, args,
kwargs, retries and every other header), ``"Type: message"`` of the exception and its
traceback. ``celery pgqueue dead list --reason failed`` shows them, ``dead requeue``
runs them again with their task id (their result is then overwritten), and ``dead purge
--older-than 7d`` trims them.

They are kept for ``pgqueue_keep_failed_for`` (a ``timedelta`` or seconds; default 7
days; None: for ever): every worker on pgqueue deletes older ones as it starts and then
every ``pgqueue_sweep_interval`` seconds (:func:`trim`, called by the worker's sweep in
:mod:`celery_pgqueue._worker`), so the table cannot grow without bound. Each worker says
in its log, once, what it keeps and for how long.

The ``task_failure`` signal does it, in the process that ran the task (the prefork
pool's child; the worker's main process for a lost pool process or a hard time limit),
by one statement (:meth:`kombu_pgqueue.admin.Broker.bury_failed`). It knows the
delivery (message id and lease) from the task's request. With late acks the
stored message is still held: it is copied and the worker's ack deletes it, or, when the
worker rejects failed tasks (``task_acks_on_failure_or_timeout=False``), it is moved.
With early acks the message is gone: it is written again from the request, in the
task's serializer. Either way the letter has the message's id and the same content.

Not kept: tasks that ``Retry`` (not a failure), that raise ``Reject`` (the broker
buries or requeues the message itself), eager calls, and failures whose message Celery
requeues (a lost worker with ``reject_on_worker_lost``, a time limit with late acks and
``acks_on_timeout`` off), for which it sends no ``task_failure`` with a request.
"""

from __future__ import annotations

import logging
import traceback as tb
import weakref
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from celery import signals
from celery.exceptions import Reject, TimeLimitExceeded, WorkerLostError
from kombu import compression, serialization
from kombu.utils.json import dumps

from kombu_pgqueue import admin, codec

logger = logging.getLogger(__name__)

#: the Celery setting that turns the archive on
SETTING = "pgqueue_keep_failed"

#: the Celery setting for how long a failed task's letter is kept (None: for ever)
RETENTION = "pgqueue_keep_failed_for"

#: how long, unless the setting says otherwise: a week of failures to look into
DEFAULT_RETENTION = timedelta(days=7)

#: the dead letters' reason for a task that failed for good
REASON = "failed"

#: what Celery adds to a task's request beside the message's headers (the delivery, the
#: body's parts, the worker's own state)
NOT_HEADERS = frozenset(
    {
        "args", "kwargs", "callbacks", "errbacks", "chain", "chord",
        "properties", "reply_to", "correlation_id", "delivery_info", "hostname",
        "is_eager", "called_directly", "headers", "time_limit", "soft_time_limit",
        "logfile", "loglevel", "taskset", "utc",
    }
)  # fmt: skip

#: the parts of the delivery that a claim adds to the stored properties
_DELIVERY_ONLY = (
    "redelivered",
    "pgqueue_id",
    "pgqueue_queue",
    "pgqueue_attempts",
    "pgqueue_handoff",
)

_brokers: weakref.WeakKeyDictionary[Any, admin.Broker] = weakref.WeakKeyDictionary()


def error_text(exception: BaseException) -> str:
    """``"Type: message"``, the type module-qualified unless it is a builtin."""
    # an exception Celery could not pickle arrives wrapped, naming the original
    module = getattr(exception, "exc_module", None) or type(exception).__module__
    name = getattr(exception, "exc_cls_name", None) or type(exception).__qualname__
    kind = name if module == "builtins" else f"{module}.{name}"
    text = str(exception)
    return f"{kind}: {text}" if text else kind


def rebuilt(task: Any, request: Any) -> admin.Outgoing | None:
    """The message a task ran from, as its request tells it; None if it did not come
    from a pgqueue broker. Its content type is the task's serializer's."""
    properties = dict(getattr(request, "properties", None) or {})
    delivery = dict(properties.get("delivery_info") or {})
    queue = delivery.get("pgqueue_queue")
    if queue is None or delivery.get("pgqueue_id") is None:
        return None
    properties.pop("delivery_tag", None)
    for key in _DELIVERY_ONLY:
        delivery.pop(key, None)
    properties["delivery_info"] = delivery
    fields = vars(request)
    headers = {k: v for k, v in fields.items() if k not in NOT_HEADERS and not k.startswith("_")}
    embed = {part: fields.get(part) for part in ("callbacks", "errbacks", "chain", "chord")}
    content_type, content_encoding, body = serialization.dumps(
        (list(request.args or ()), dict(request.kwargs or {}), embed), serializer=task.serializer
    )
    data = body.encode(content_encoding or "utf-8") if isinstance(body, str) else bytes(body)
    if headers.get("compression"):
        data, _ = compression.compress(data, headers["compression"])
    return admin.Outgoing(
        queue=str(queue),
        body=data,
        headers=str(dumps(headers)),
        properties=str(dumps(properties)),
        content_type=content_type,
        content_encoding=content_encoding,
        priority=_priority(properties),
        dedup_key=codec.dedup_key(headers, properties, None),
    )


def failure(task: Any, request: Any, exception: BaseException, einfo: Any) -> admin.Failure | None:
    """What :meth:`~kombu_pgqueue.admin.Broker.bury_failed` needs of a failed task."""
    message = rebuilt(task, request)
    if message is None:
        return None
    properties: Mapping[str, Any] = request.properties
    _, lease = codec.parse_tag(str(properties.get("delivery_tag") or "0"))
    text = getattr(einfo, "traceback", None)
    if text is None:
        text = "".join(tb.format_exception(type(exception), exception, exception.__traceback__))
    return admin.Failure(
        id=int(properties["delivery_info"]["pgqueue_id"]),
        lease=lease,
        attempts=int(properties["delivery_info"].get("pgqueue_attempts") or 1),
        message=message,
        error=error_text(exception),
        traceback=str(text),
        move=_rejected_next(task, exception),
    )


def _rejected_next(task: Any, exception: BaseException) -> bool:
    """Whether the worker rejects the message after this signal instead of acking it:
    late acks with acks on failure off. The main process signals a lost pool process
    and a hard time limit after it settled the message."""
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)) or not task.acks_late:
        return False
    on_failure = getattr(task, "acks_on_failure", None)  # Celery 5.6+
    if on_failure is None:
        on_failure = task.acks_on_failure_or_timeout
    return not on_failure


def _priority(properties: Mapping[str, Any]) -> int:
    try:
        return max(0, min(int(properties["priority"]), 255))
    except (TypeError, ValueError, KeyError):
        return 0


def broker(app: Any) -> admin.Broker:
    """The app's broker, made once per app (the process's pool is made on first use,
    again in a forked child)."""
    found = _brokers.get(app)
    if found is None:
        with app.connection_for_write() as conn:
            found = _brokers[app] = admin.Broker.from_connection(conn)
    return found


def retention(conf: Any) -> timedelta | None:
    """How long the app keeps failed tasks' letters (None: for ever)."""
    value = conf.get(RETENTION, DEFAULT_RETENTION)
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=float(value))


def trim(app: Any, *, now: datetime | None = None) -> int:
    """Delete the failed tasks' letters kept longer than :func:`retention`, as of ``now``
    (None: the database server's clock); return how many. Letters of other reasons
    (rejected, max_attempts, ...) are the operator's to purge."""
    kept_for = retention(app.conf)
    if kept_for is None:
        return 0
    return broker(app).purge_dead(reason=REASON, older_than=kept_for, now=now)


def keep_failed(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    einfo: Any = None,
    **_: Any,
) -> None:
    """``task_failure`` receiver: keep the task in the dead letters (see the module)."""
    task = sender
    if task is None or exception is None or not task.app.conf.get(SETTING):
        return
    request = task.request
    if getattr(request, "is_eager", False) or isinstance(exception, Reject):
        return
    if request.id != task_id:
        # a hard time limit's first signal, sent with no request: the main process sends
        # another with it when it settles the message, unless it requeues the message
        logger.debug("pgqueue: task %s[%s] failed with no request to read", task.name, task_id)
        return
    try:
        found = failure(task, request, exception, einfo)
        if found is None:
            return  # not delivered by a pgqueue broker
        kept = broker(task.app).bury_failed(found)
    except Exception:
        logger.exception(
            "pgqueue: task %s[%s] failed for good and could not be kept in the dead letters",
            task.name,
            task_id,
        )
        return
    if kept is None:
        logger.info(
            "pgqueue: task %s[%s] failed, but its message is held by another delivery now "
            "(this one's lease ran out): it runs again there",
            task.name,
            task_id,
        )
        return
    logger.info(
        "pgqueue: task %s[%s] failed for good; kept as dead letter %s "
        "(celery pgqueue dead show %s)",
        task.name,
        task_id,
        kept,
        kept,
    )


signals.task_failure.connect(keep_failed, weak=False, dispatch_uid="celery_pgqueue.keep_failed")
