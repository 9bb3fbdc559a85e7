"""An app for ``celery -A fleet_app worker`` processes whose sessions the fleet tests count:
built from ``PGQUEUE_DSN`` and ``PGQUEUE_SCHEMA``, results in the broker's schema, and
any transport option as ``PGQUEUE_OPT_<NAME>`` (a number or a word)."""

from __future__ import annotations

import os
import threading
from typing import Any

from celery import Celery
from celery_apps import celery_app, lazy_app

#: what a task waits on until the test lets it end (a busy worker): the file's presence
GATE = "PGQUEUE_GATE"


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def transport_options(environ: dict[str, str]) -> dict[str, Any]:
    prefix = "PGQUEUE_OPT_"
    return {k[len(prefix) :].lower(): _value(v) for k, v in environ.items() if k.startswith(prefix)}


def make_app(dsn: str, schema: str, **options: Any) -> Celery:
    conf = {"database_table_schemas": {"task": schema, "group": schema}}
    app = celery_app(dsn, schema, main="fleet", conf=conf, **options)

    @app.task(name="fleet.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="fleet.hold", shared=False)
    def hold(gate: str) -> str:
        """Runs until file ``gate`` exists."""
        done = threading.Event()
        while not os.path.exists(gate):
            done.wait(0.05)
        return os.path.basename(gate)

    return app


__getattr__ = lazy_app(
    globals(),
    lambda: make_app(
        os.environ["PGQUEUE_DSN"],
        os.environ["PGQUEUE_SCHEMA"],
        **transport_options(dict(os.environ)),
    ),
)
