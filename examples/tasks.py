"""A small Celery project on pgqueue. The broker and result backend come from one DSN.

Run a worker:

    PGQUEUE_DSN=postgresql://... celery -A tasks worker -Q pgqueue_demo,pgqueue_demo_io -l info

Everything of the demo's lives in a schema of its own (``pgqueue_demo``, or
``PGQUEUE_DEMO_SCHEMA``): its queues, exchanges and dead letters, and Celery's result
tables. Pointed at a database that already has a pgqueue broker (schema ``pgqueue``),
it never sees that broker's queues, so it cannot consume your tasks. Remove it with
``DROP SCHEMA pgqueue_demo CASCADE``.
"""

from __future__ import annotations

import hashlib
import os

from celery import Celery

import celery_pgqueue

SCHEMA = os.environ.get("PGQUEUE_DEMO_SCHEMA", "pgqueue_demo")
#: the demo's queues; named for it, so a worker of yours listening on "celery" in the
#: same schema would not take them either
QUEUE = "pgqueue_demo"
IO_QUEUE = "pgqueue_demo_io"

app = Celery("demo")
celery_pgqueue.configure(
    app,
    os.environ["PGQUEUE_DSN"],
    schema=SCHEMA,
    visibility_timeout=30,
)
app.conf.update(
    # results in the demo's schema too (migrate it first: see demo.py)
    database_table_schemas={"task": SCHEMA, "group": SCHEMA},
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    task_routes={"tasks.checksum": {"queue": IO_QUEUE}},
    task_queue_max_priority=10,
    task_default_priority=5,
    worker_hijack_root_logger=False,
)


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@app.task
def total(numbers: list[int]) -> int:
    return sum(numbers)


@app.task(bind=True, autoretry_for=(ZeroDivisionError,), retry_backoff=0.1, max_retries=3)
def flaky(self, n: int) -> float:
    # fails on the first two tries, succeeds on the third
    if self.request.retries < 2:
        raise ZeroDivisionError("not yet")
    return n / 1
