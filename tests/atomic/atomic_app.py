"""The Celery app of the atomic-task tests, in-process and in ``celery worker`` processes.

``celery -A atomic_app worker`` builds it from the environment (see :func:`worker_env`):
``ATOMIC_DSN``, ``ATOMIC_SCHEMA``, transport options as ``ATOMIC_<OPTION>`` and
``ATOMIC_PREFETCH`` (1): ``worker_prefetch_multiplier``.

Tables, in the test's schema (:func:`create_tables`):

* ``effect``: what the tasks' transactions write, one row per committed effect, with a
  plain INSERT and no unique key, so an effect applied twice shows as two rows.
* ``attempt``: every start of a task body, written on a connection of its own in
  autocommit, so it shows attempts whose transaction rolled back.
* ``gate``: a task given a gate waits, inside its transaction, until the test opens it
  (``helpers.open_gate``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from celery_apps import celery_app, lazy_app
from celery_workers import app_env
from helpers import wait_gate
from psycopg import sql

from celery_pgqueue.atomic import AtomicTask

#: how long a task waits for its gate before giving up (it must never outlive a test)
GATE_LIMIT = 60.0


class Boom(Exception):
    """Raised by a task body on purpose."""


def create_tables(conn: psycopg.Connection, schema: str) -> None:
    for statement in (
        "CREATE TABLE {}.effect (key text NOT NULL, task_id text NOT NULL, "
        "at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE TABLE {}.attempt (key text NOT NULL, task_id text NOT NULL, pid int NOT NULL, "
        "retries int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE TABLE {}.gate (name text PRIMARY KEY)",
    ):
        conn.execute(sql.SQL(statement).format(sql.Identifier(schema)))


#: ``worker_env(dsn, schema, **options)``: the environment of a ``celery -A atomic_app
#: worker`` process; ``options`` are transport options (``visibility_timeout=2``)
worker_env = partial(app_env, Path(__file__).resolve().parent, prefix="ATOMIC")


_FLOATS = ("visibility_timeout", "lease_renewal_interval", "polling_interval")


def make_app(dsn: str, schema: str, **options: Any) -> Celery:
    app = celery_app(
        dsn,
        schema,
        main="atomic",
        conf={"task_ignore_result": False, "worker_hijack_root_logger": True},
        **options,
    )
    effect_table = sql.Identifier(schema, "effect")
    attempt_table = sql.Identifier(schema, "attempt")

    def attempt(task: Any, key: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (key, task_id, pid, retries) VALUES (%s, %s, %s, %s)"
                ).format(attempt_table),
                (key, task.request.id or "", os.getpid(), task.request.retries or 0),
            )

    def write(task: Any, key: str) -> None:
        task.db.execute(
            sql.SQL("INSERT INTO {} (key, task_id) VALUES (%s, %s)").format(effect_table),
            (key, task.request.id or ""),
        )

    @app.task(bind=True, base=AtomicTask, name="atomic.effect", shared=False)
    def effect(
        self: Any,
        key: str,
        gate: str | None = None,
        fail: bool = False,
        follow: str | None = None,
    ) -> str:
        """Write ``key``; then send ``effect(follow)``, wait for ``gate``, raise if ``fail``."""
        attempt(self, key)
        write(self, key)
        if follow:
            effect.delay(follow)
        if gate:
            wait_gate(dsn, schema, gate, GATE_LIMIT)
        if fail:
            raise Boom(key)
        return key

    @app.task(bind=True, base=AtomicTask, name="atomic.retrying", shared=False)
    def retrying(self: Any, key: str) -> str:
        """Write ``key#<retries>``; the first attempt asks for a retry."""
        attempt(self, key)
        write(self, f"{key}#{self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return key

    @app.task(
        bind=True,
        base=AtomicTask,
        name="atomic.autoretry",
        shared=False,
        autoretry_for=(Boom,),
        max_retries=3,
        default_retry_delay=0,
    )
    def autoretry(self: Any, key: str) -> str:
        """Write ``key#<retries>``; raise Boom (retried by Celery) on the first attempt."""
        attempt(self, key)
        write(self, f"{key}#{self.request.retries}")
        if self.request.retries == 0:
            raise Boom(key)
        return key

    @app.task(bind=True, base=AtomicTask, name="atomic.replaced", shared=False)
    def replaced(self: Any, key: str) -> None:
        """Write ``key``, then replace itself by ``effect(key + '-replacement')``."""
        attempt(self, key)
        write(self, key)
        raise self.replace(effect.si(f"{key}-replacement"))

    return app


def app_from_environment(env: Mapping[str, str] = os.environ) -> Celery:
    options: dict[str, Any] = {}
    for name in _FLOATS:
        value = env.get(f"ATOMIC_{name.upper()}")
        if value:
            options[name] = float(value)
    if env.get("ATOMIC_LOG_ACKS"):
        # the consumer's batches of atomic tasks' acks ("1 of 1 acks of atomic tasks
        # deleted a row"), in the worker's log
        logging.getLogger("kombu_pgqueue._settler").setLevel(logging.DEBUG)
    app = make_app(env["ATOMIC_DSN"], env["ATOMIC_SCHEMA"], **options)
    app.conf.worker_prefetch_multiplier = int(env.get("ATOMIC_PREFETCH", "1"))
    return app


__getattr__ = lazy_app(globals(), app_from_environment)
