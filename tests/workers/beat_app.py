"""The Celery app that ``test_features`` runs in real processes: ``celery beat`` and
``celery worker``.

``celery -A beat_app beat|worker`` builds it from the environment:

* ``PGQUEUE_DSN`` (required): libpq DSN or URL of the test database.
* ``PGQUEUE_SCHEMA`` (required): the test's broker schema; the ledger lives there too.
* ``PGQUEUE_BEAT_EVERY`` (unset): seconds between ``feat.record("tick")`` sent by beat.
* ``PGQUEUE_BROADCAST`` (unset): name of a :class:`kombu.common.Broadcast` queue that
  every worker consumes besides ``celery`` (each process gets a queue of its own).
* ``PGQUEUE_PREFETCH`` (1): ``worker_prefetch_multiplier``.

Tasks write every execution to the ``ledger`` table of the schema (``ledger.Ledger``),
so the tests count executions in the database instead of trusting results or logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from celery import Celery
from celery_apps import celery_app, lazy_app
from celery_workers import app_env
from kombu import Queue
from kombu.common import Broadcast
from ledger import Ledger

#: how long a blocked task waits for its gate (it must never outlive a test)
GATE_LIMIT = 60.0


#: ``process_env(dsn, schema, **settings)``: the environment for ``celery -A beat_app
#: ...``; ``settings`` are the variables above without the prefix, in lower case
process_env = partial(app_env, Path(__file__).resolve().parent)


def make_app(
    dsn: str,
    schema: str,
    *,
    beat_every: float | None = None,
    broadcast: str | None = None,
    prefetch: int = 1,
) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="features",
        results=False,
        conf={
            "task_ignore_result": True,
            "worker_prefetch_multiplier": prefetch,
            # the tests read the worker's log (" ready.")
            "worker_hijack_root_logger": True,
        },
    )
    if broadcast:
        app.conf.task_queues = (Queue("celery"), Broadcast(broadcast))
    if beat_every:
        app.conf.beat_schedule = {
            "tick": {"task": "feat.record", "schedule": beat_every, "args": ("tick",)}
        }
    ledger = Ledger(dsn, schema)

    @app.task(name="feat.record", shared=False, bind=True)
    def record(self: Any, label: str) -> str:
        ledger.finish(ledger.start(self, label))
        return label

    @app.task(name="feat.block", shared=False, bind=True)
    def block(self: Any, label: str, gate: str) -> str:
        """Run until a row named ``gate`` is in the gate table."""
        run = ledger.start(self, label)
        ledger.wait_gate(gate, GATE_LIMIT)
        ledger.finish(run)
        return label

    return app


def app_from_environment(env: Mapping[str, str] = os.environ) -> Celery:
    every = env.get("PGQUEUE_BEAT_EVERY")
    return make_app(
        env["PGQUEUE_DSN"],
        env["PGQUEUE_SCHEMA"],
        beat_every=float(every) if every else None,
        broadcast=env.get("PGQUEUE_BROADCAST") or None,
        prefetch=int(env.get("PGQUEUE_PREFETCH", "1")),
    )


__getattr__ = lazy_app(globals(), app_from_environment)
