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
from typing import Any

from celery import Celery
from celery_apps import celery_app, lazy_app

SCHEDULER = "celery_pgqueue.beat:Scheduler"


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
