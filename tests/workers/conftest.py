"""Celery fixtures: a real in-process worker on the ``app`` of ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker


@pytest.fixture
def worker(app: Celery) -> Iterator[object]:
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=True, shutdown_timeout=30
    ) as w:
        yield w
