"""A small Celery project on pgqueue. The broker and result backend come from one DSN.

Run a worker:   PGQUEUE_DSN=postgresql://... celery -A tasks worker -l info
"""

from __future__ import annotations

import hashlib
import os

from celery import Celery

import celery_pgqueue

app = Celery("demo")
celery_pgqueue.configure(
    app,
    os.environ["PGQUEUE_DSN"],
    visibility_timeout=30,
)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    task_routes={"tasks.checksum": {"queue": "io"}},
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
