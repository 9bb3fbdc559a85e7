"""Which pools take no handoffs, decided at worker_init without importing the pool."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadPool

from celery_pgqueue._worker import blocks_its_loop


@pytest.mark.parametrize(
    ("pool", "blocks"),
    [
        ("solo", True),
        ("celery.concurrency.solo:TaskPool", True),
        (SoloPool, True),
        ("prefork", False),
        ("threads", False),
        ("gevent", False),
        (ThreadPool, False),
    ],
)
def test_a_solo_pool_blocks_its_loop(pool: object, blocks: bool) -> None:
    assert blocks_its_loop(pool) is blocks


def test_a_pool_named_is_not_imported_before_the_worker_does() -> None:
    # Celery imports the pool after worker_init, so that a handler there can
    # monkey-patch first (gevent, eventlet); importing it at worker_init undid that
    code = (
        "import sys; from celery_pgqueue._worker import blocks_its_loop; "
        "blocks_its_loop('eventlet'); blocks_its_loop('threads'); "
        "print(sorted(m for m in ('celery.concurrency.eventlet', 'celery.concurrency.thread') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
