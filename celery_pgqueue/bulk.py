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

Plain signatures (options among task_id, queue, priority, eta, countdown, expires,
dedup_key) are written from a per-task template (:mod:`celery_pgqueue._template`);
any other option (links, chains, time limits ...) goes through apply_async's own
message builder. While the database stores one batch, the next one is being built.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from itertools import islice
from typing import Any

from celery import Celery

from kombu_pgqueue import admin, codec, transactions

from ._template import MessageTemplate
from .messages import task_message

#: signature options the template writes itself; any other goes the exact way
_FAST_OPTIONS = frozenset(
    {"task_id", "queue", "priority", "eta", "countdown", "expires", "dedup_key"}
)


@dataclass(slots=True)
class BulkReport:
    enqueued: int = 0
    skipped: int = 0
    task_ids: list[str] = field(default_factory=list)


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # RFC 4122 variant bits


def _task_ids(count: int) -> list[str]:
    """``count`` random (version 4) UUIDs as text: what ``str(uuid4())`` gives, in bulk."""
    raw = os.urandom(16 * count).hex()
    found = []
    for start in range(0, 32 * count, 32):
        h = raw[start : start + 32]
        found.append(f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}")
    return found


def _when(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


class BulkSender:
    """Writes task messages for ``app`` straight into its pgqueue broker."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._templates: dict[tuple[str, str | None, bool], MessageTemplate] = {}
        conn = app.connection_for_write()
        try:
            # connects as apply_async does (the retry policy, failover URLs, the schema
            # check) before the first batch is built; rows go to the URL that answered
            conn.default_channel  # noqa: B018 - the property connects
            self.broker = admin.Broker.from_connection(conn)
        finally:
            conn.release()
        self._dedup_ids = self.broker.options.dedup_task_ids

    def template(self, name: str, queue: str | None, keyed: bool) -> MessageTemplate:
        key = (name, queue, keyed)
        found = self._templates.get(key)
        if found is None:
            found = MessageTemplate(self.app, name, queue=queue, priority=None, keyed=keyed)
            self._templates[key] = found
        return found

    def row(self, sig: Any, task_id: str) -> tuple[Any, ...]:
        """The staging row of one signature (see kombu_pgqueue.admin.STAGING_COLUMNS)."""
        fields: dict[str, Any] = sig  # a Signature is a dict: read its items, not properties
        options: dict[str, Any] = fields["options"]
        if not options.keys() <= _FAST_OPTIONS:
            return self._exact(sig)
        eta = _when(options.get("eta"))
        if options.get("countdown") is not None:
            eta = datetime.now(timezone.utc) + timedelta(seconds=float(options["countdown"]))
        expires = options.get("expires")
        if expires is not None and not isinstance(expires, datetime):
            expires = datetime.now(timezone.utc) + timedelta(seconds=float(expires))
        dedup_key = options.get("dedup_key")
        template = self.template(fields["task"], options.get("queue"), dedup_key is not None)
        priority = options.get("priority")
        args = tuple(fields.get("args") or ())
        kwargs: dict[str, Any] = fields.get("kwargs") or {}
        row = template.message(
            args,
            kwargs,
            template.body(args, kwargs),
            task_id,
            dedup_key,
            template.priority if priority is None else priority,
            eta,
            expires,
        )
        if dedup_key is None and not self._dedup_ids:
            row = row[:4] + (None,) + row[5:]
        return row

    def _exact(self, sig: Any) -> tuple[Any, ...]:
        # links, chains, time limits...: through apply_async's own message builder
        built = task_message(self.app, sig.task, tuple(sig.args), dict(sig.kwargs), **sig.options)
        message = codec.stamp(built.message, "", built.queue)
        task_keys: codec.TaskKeys = "task" if self._dedup_ids else None
        return codec.outgoing(built.queue, message, task_keys=task_keys).row()


def send_many(app: Celery, signatures: Iterable[Any], *, batch_size: int = 10_000) -> BulkReport:
    """Publish every signature; return how many were enqueued and skipped.

    Inside :func:`kombu_pgqueue.transaction` every batch is written through the
    application's transaction, in this thread; otherwise a helper thread stores each
    batch while the next is built.
    """
    report = BulkReport()
    sender = BulkSender(app)
    writer = ThreadPoolExecutor(1, "pgqueue-bulk") if transactions.current() is None else None
    pending: Future[int] | None = None
    pending_size = 0

    def settle() -> None:
        nonlocal pending
        if pending is not None:
            stored = pending.result()
            report.enqueued += stored
            report.skipped += pending_size - stored
            pending = None

    try:
        iterator = iter(signatures)
        while batch := list(islice(iterator, batch_size)):
            rows: list[Sequence[Any]] = []
            for sig, fresh in zip(batch, _task_ids(len(batch))):
                task_id = sig.options.setdefault("task_id", fresh)
                rows.append(sender.row(sig, task_id))
                report.task_ids.append(task_id)
            settle()
            if writer is None:
                stored = sender.broker.publish_rows(rows)
                report.enqueued += stored
                report.skipped += len(rows) - stored
            else:
                pending, pending_size = writer.submit(sender.broker.publish_rows, rows), len(rows)
        settle()
    finally:
        if writer is not None:
            writer.shutdown(wait=True)
    return report
