"""The Celery app of the periodic task tests, for real ``celery beat`` processes and
``celery pgqueue schedule`` commands.

``celery -A periodic_app beat`` builds it from ``PGQUEUE_DSN`` and ``PGQUEUE_SCHEMA``:
no result backend, scheduler ``celery_pgqueue.beat:Scheduler`` (``PGQUEUE_SCHEDULER``
names another, such as Celery's own ``celery.beat:PersistentScheduler``), and, with
``PGQUEUE_EVERY`` set, one ``beat_schedule`` entry ``tick`` that sends ``periodic.tick``
every that many seconds; ``PGQUEUE_NODE`` is the beat's node name
(``pgqueue_beat_node``), ``PGQUEUE_EXCLUSIVE=0`` lets every beat send (no lead). The
other pgqueue_beat_* settings keep their defaults. Nothing consumes the queue: the
tests count the messages the beats sent, by the entry and due time in their headers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from celery_apps import celery_app, lazy_app
from celery_workers import app_env
from psycopg import sql

from kombu_pgqueue.schedule import EntrySpec, Missed

SCHEDULER = "celery_pgqueue.beat:Scheduler"
HERE = Path(__file__).resolve().parent
#: the moved clock's start in the in-process tests
T0 = datetime(2027, 1, 4, 12, 0, 0, tzinfo=timezone.utc)


def every(name: str, seconds: float, missed: Missed = "once") -> EntrySpec:
    """An entry sending ``periodic.tick`` every ``seconds``."""
    return EntrySpec(
        name=name,
        task="periodic.tick",
        schedule={"kind": "interval", "every": seconds, "relative": False},
        missed=missed,
    )


#: ``process_env(dsn, schema, **settings)``: the environment of ``celery -A periodic_app
#: ...``; ``settings`` are ``PGQUEUE_*`` variables without the prefix, in lower case
process_env = partial(app_env, HERE)


@dataclass(frozen=True, slots=True)
class Sent:
    """A message a beat sent: its entry, its due time and when it was stored."""

    entry: str
    due: datetime
    stored: datetime


def sent(db: psycopg.Connection, schema: str) -> list[Sent]:
    """Every periodic send in the schema's queues, by due time."""
    rows = db.execute(
        sql.SQL(
            "SELECT headers->>'pgqueue_beat_entry', (headers->>'pgqueue_beat_due')::timestamptz,"
            " created_at FROM {} WHERE headers->>'pgqueue_beat_entry' IS NOT NULL"
            " ORDER BY 2, 1"
        ).format(sql.Identifier(schema, "message_store"))
    ).fetchall()
    return [Sent(*row) for row in rows]


def make_app(
    dsn: str,
    schema: str,
    *,
    every: float | None = None,
    scheduler: str = SCHEDULER,
    node: str | None = None,
    exclusive: bool = True,
    conf: Mapping[str, Any] | None = None,
) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="periodic",
        results=False,
        conf={
            "beat_scheduler": scheduler,
            "task_ignore_result": True,
            "result_expires": None,
            "pgqueue_beat_exclusive": exclusive,
            **({"pgqueue_beat_node": node} if node else {}),
            **(conf or {}),
        },
    )
    if every:
        app.conf.beat_schedule = {"tick": {"task": "periodic.tick", "schedule": every}}

    @app.task(name="periodic.tick", shared=False)
    def tick(*args: Any, **kwargs: Any) -> None:
        """Never run: the tests count the messages beat sends."""

    return app


def app_from_environment(env: Mapping[str, str] = os.environ) -> Celery:
    every = env.get("PGQUEUE_EVERY")
    return make_app(
        env["PGQUEUE_DSN"],
        env["PGQUEUE_SCHEMA"],
        every=float(every) if every else None,
        scheduler=env.get("PGQUEUE_SCHEDULER") or SCHEDULER,
        node=env.get("PGQUEUE_NODE") or None,
        exclusive=env.get("PGQUEUE_EXCLUSIVE", "1") != "0",
    )


__getattr__ = lazy_app(globals(), app_from_environment)
