"""Helpers shared by the tx tests: polling with a deadline, and a Celery app."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

import celery_pgqueue


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        threading.Event().wait(0.05)


def stays_false(condition: Callable[[], Any], seconds: float) -> bool:
    """True if ``condition`` never became truthy during ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return False
        threading.Event().wait(0.05)
    return not condition()


def make_app(celery_dsn: str, schema: str, **options: Any) -> Celery:
    app = Celery(f"tx_{schema}", set_as_current=False)
    celery_pgqueue.configure(
        app,
        celery_dsn,
        schema=schema,
        polling_interval=0.5,
        visibility_timeout=10,
        **options,
    )
    app.conf.update(
        result_backend_always_retry=False,
        task_default_queue="celery",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        database_short_lived_sessions=True,
    )
    return app
