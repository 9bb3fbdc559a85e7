"""Fan out many Celery tasks in a few round trips.

.. code-block:: python

    from celery_pgqueue.bulk import send_many
    report = send_many(app, (scrape.s(url) for url in urls))
    report.enqueued, report.skipped

Messages are what ``apply_async`` sends (protocol 2, JSON). They go in by COPY,
``batch_size`` at a time, with one NOTIFY per queue and batch. A message whose dedup
key is already waiting or running is skipped and counted: the key is
``dedup_key=`` from the signature's options, else its task id, so sending the same
signatures (same task ids) twice enqueues them once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import islice
from typing import Any
from uuid import uuid4

from celery import Celery

from kombu_pgqueue._store import Outgoing, Store

from .messages import TaskMessageFactory, task_message

#: signature options the template factory writes itself; any other goes the exact way
_FAST_OPTIONS = frozenset(
    {"task_id", "queue", "priority", "eta", "countdown", "expires", "dedup_key"}
)


@dataclass(slots=True)
class BulkReport:
    enqueued: int = 0
    skipped: int = 0
    task_ids: list[str] = field(default_factory=list)


def _when(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


class BulkSender:
    """Writes task messages for ``app`` straight into its pgqueue broker."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._factories: dict[tuple[str, str | None, int | None], TaskMessageFactory] = {}
        self._conn = app.connection_for_write()
        self.store: Store = self._conn.default_channel.store

    def factory(self, name: str, queue: str | None, priority: int | None) -> TaskMessageFactory:
        key = (name, queue, priority)
        found = self._factories.get(key)
        if found is None:
            dedup = self.store.options.dedup_task_ids
            found = TaskMessageFactory(
                self.app, name, queue=queue, priority=priority, dedup_task_ids=dedup
            )
            self._factories[key] = found
        return found

    def message(self, sig: Any) -> Outgoing:
        options = sig.options
        if set(options) - _FAST_OPTIONS:
            return self._exact(sig)
        eta = _when(options.get("eta"))
        if options.get("countdown") is not None:
            eta = datetime.now(timezone.utc) + timedelta(seconds=float(options["countdown"]))
        expires = options.get("expires")
        if expires is not None and not isinstance(expires, datetime):
            expires = datetime.now(timezone.utc) + timedelta(seconds=float(expires))
        factory = self.factory(sig.task, options.get("queue"), options.get("priority"))
        return factory.outgoing(
            sig.args,
            sig.kwargs,
            task_id=options.get("task_id"),
            eta=eta,
            expires=expires,
            dedup_key=options.get("dedup_key"),
        )

    def _exact(self, sig: Any) -> Outgoing:
        # links, chains, time limits...: through apply_async's own message builder
        built = task_message(self.app, sig.task, tuple(sig.args), dict(sig.kwargs), **sig.options)
        channel = self._conn.default_channel
        channel._inplace_augment_message(built.message, "", built.queue)
        return channel._outgoing(built.queue, built.message)

    def close(self) -> None:
        self._conn.release()


def send_many(app: Celery, signatures: Iterable[Any], *, batch_size: int = 10_000) -> BulkReport:
    """Publish every signature; return how many were enqueued and skipped."""
    report = BulkReport()
    sender = BulkSender(app)
    try:
        iterator = iter(signatures)
        while batch := list(islice(iterator, batch_size)):
            messages = []
            for sig in batch:
                sig.options.setdefault("task_id", str(uuid4()))
                messages.append(sender.message(sig))
                report.task_ids.append(sig.options["task_id"])
            stored = sender.store.publish_many(messages)
            report.enqueued += stored
            report.skipped += len(messages) - stored
    finally:
        sender.close()
    return report
