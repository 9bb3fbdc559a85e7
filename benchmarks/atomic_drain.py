"""The ``atomic`` group (pgqueue only): what exactly-once effects cost a worker.

Drain rate of tasks that each write one row, as :class:`celery_pgqueue.AtomicTask`
(the row, the ack and what the worker sends commit in one transaction of the task's
connection) and as plain ``acks_late`` tasks writing the same row on a connection of
their own, kept between tasks like the atomic task's, then acked by the worker:
``plain`` in autocommit (one statement), ``plaintx`` in a transaction (``BEGIN``,
``INSERT``, ``COMMIT``: what a psycopg connection does by default, and an ORM session).
The same worker (prefork -c 2, threads -c 8) drains the same backlog size
(``celery_n``) of each kind. Figures: tasks/s from the first row written to the last
(the server's clock at each INSERT); atomic / plain (the issue's figure, target 0.8)
and atomic / plaintx. The kinds rotate which goes first from run to run.

The workers run ``celery -A benchmarks.atomic_drain worker``: this module's app, with
:data:`benchmarks.bench_app.COMMON_SETTINGS`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

from .bench_app import COMMON_SETTINGS
from .config import ROOT, WORKER_FLAGS, Ctx, log
from .peers import Broker, declare, delete_queue

POOLS = (("prefork", 2), ("threads", 8))
TABLE = "atomic_bench"
KINDS = ("plain", "plaintx", "atomic")
#: how each kind writes its row
KIND_LABELS = {
    "plain": "acks_late task, autocommit",
    "plaintx": "acks_late task, own transaction",
    "atomic": "AtomicTask",
}

ATOMIC_FIGURES: Mapping[str, tuple[str, str, str]] = {
    f"atomic_{kind}_{pool}": (
        f"Drain writing a row, {KIND_LABELS[kind]}, {pool} -c {conc}",
        "tasks/s",
        "higher",
    )
    for pool, conc in POOLS
    for kind in KINDS
} | {
    f"atomic_ratio{base}_{pool}": (
        f"AtomicTask / {KIND_LABELS[base or 'plain']}, {pool} -c {conc}",
        "x",
        "higher",
    )
    for pool, conc in POOLS
    for base in ("", "plaintx")
}


def bench_atomic(ctx: Ctx, broker: Broker, run: int) -> dict[str, list[float]]:
    """Both kinds on each pool, one backlog each; empty for other brokers."""
    if broker.name != "pgqueue":
        return {}
    n = ctx.sizes["celery_n"]
    schema = broker.options["schema"]
    table = sql.Identifier(schema, TABLE)
    out: dict[str, list[float]] = {}
    with psycopg.connect(ctx.settings.dsn, autocommit=True) as conn:
        declare(broker, ctx.queue(broker, "atomic_setup"))  # the schema, migrated
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} "
                "(kind text NOT NULL, task_id text NOT NULL, at float8 NOT NULL)"
            ).format(table)
        )
        for pool, conc in POOLS:
            rates: dict[str, float] = {}
            for kind in KINDS[run % 3 :] + KINDS[: run % 3]:
                tag = f"{kind}_{pool}"
                rate = _drain(ctx, broker, conn, schema, tag, pool, conc, n)
                if rate is not None:
                    rates[kind] = rate
                    out[f"atomic_{tag}"] = [rate]
                    log(f"  pgqueue  atomic {tag:16s} {rate:8.0f} tasks/s")
            for base in ("plain", "plaintx"):
                if "atomic" in rates and base in rates:
                    key = f"atomic_ratio{'' if base == 'plain' else base}_{pool}"
                    out[key] = [rates["atomic"] / rates[base]]
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
    return out


def _drain(
    ctx: Ctx,
    broker: Broker,
    conn: psycopg.Connection,
    schema: str,
    tag: str,
    pool: str,
    concurrency: int,
    n: int,
) -> float | None:
    """Publish n tasks of one kind, start a worker, wait for n rows; tasks/s or None."""
    from celery_pgqueue.bulk import send_many

    queue = ctx.queue(broker, f"atomic_{tag}")
    declare(broker, queue)
    app = make_app(broker.url, broker.options, queue, ctx.settings.dsn, schema)
    try:
        name = f"bench.write_{tag.partition('_')[0]}"
        send_many(app, [app.signature(name, (tag,), task_id=str(uuid.uuid4())) for _ in range(n)])
    finally:
        app.close()
    count = sql.SQL("SELECT count(*), min(at), max(at) FROM {} WHERE kind = %s").format(
        sql.Identifier(schema, TABLE)
    )
    worker = _start_worker(ctx, broker, queue, pool, concurrency, tag, schema)
    try:
        deadline = time.monotonic() + ctx.sizes["drain_timeout"]
        while True:
            done, first, last = conn.execute(count, (tag,)).fetchone() or (0, None, None)
            if done >= n:
                return float((n - 1) / (last - first))
            if worker.poll() is not None or time.monotonic() > deadline:
                ctx.problem(broker.name, f"atomic_{tag}", f"{done} of {n} tasks ran")
                return None
            threading.Event().wait(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(5)
        delete_queue(broker, queue)


def _start_worker(
    ctx: Ctx,
    broker: Broker,
    queue: str,
    pool: str,
    concurrency: int,
    tag: str,
    schema: str,
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "BENCH_BROKER_URL": broker.url,
        "BENCH_TRANSPORT_OPTIONS": json.dumps(broker.options),
        "BENCH_QUEUE": queue,
        "ATOMIC_BENCH_DSN": ctx.settings.dsn,
        "ATOMIC_BENCH_SCHEMA": schema,
    }
    command = [sys.executable, "-m", "celery", "-A", __name__, "worker", "--pool", pool]
    command += ["-c", str(concurrency), *WORKER_FLAGS, "-n", f"{queue}@%h"]
    with open(os.path.join(ctx.tmp, f"worker-atomic-{tag}.log"), "wb") as log_file:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def make_app(broker: str, options: dict[str, Any], queue: str, dsn: str, schema: str) -> Celery:
    """The benchmark's app: ``bench.write_<kind>`` for each of :data:`KINDS`."""
    from celery_pgqueue.atomic import AtomicTask

    app = Celery("atomic_bench", broker=broker, set_as_current=False)
    app.conf.update(
        COMMON_SETTINGS,
        broker_transport_options=dict(options),
        task_default_queue=queue,
        task_default_exchange=queue,
        task_default_routing_key=queue,
    )
    insert = sql.SQL(
        "INSERT INTO {} (kind, task_id, at) VALUES (%s, %s, extract(EPOCH FROM clock_timestamp()))"
    ).format(sql.Identifier(schema, TABLE))
    #: each thread's connection, by autocommit (a pool child makes its own after fork)
    own = threading.local()

    def connection(autocommit: bool) -> psycopg.Connection:
        key = f"conn_{autocommit}_{os.getpid()}"
        conn: psycopg.Connection | None = getattr(own, key, None)
        if conn is None:
            conn = psycopg.connect(dsn, autocommit=autocommit)
            setattr(own, key, conn)
        return conn

    @app.task(name="bench.write_plain", acks_late=True, bind=True, shared=False)
    def write_plain(self: Any, tag: str) -> None:
        connection(autocommit=True).execute(insert, (tag, self.request.id))

    @app.task(name="bench.write_plaintx", acks_late=True, bind=True, shared=False)
    def write_plaintx(self: Any, tag: str) -> None:
        conn = connection(autocommit=False)
        conn.execute(insert, (tag, self.request.id))
        conn.commit()

    @app.task(name="bench.write_atomic", base=AtomicTask, bind=True, shared=False)
    def write_atomic(self: Any, tag: str) -> None:
        self.db.execute(insert, (tag, self.request.id))

    return app


def __getattr__(name: str) -> Any:
    # built on first use: `celery -A benchmarks.atomic_drain` looks up `app`
    if name == "app":
        env = os.environ
        globals()["app"] = built = make_app(
            env["BENCH_BROKER_URL"],
            json.loads(env.get("BENCH_TRANSPORT_OPTIONS") or "{}"),
            env["BENCH_QUEUE"],
            env["ATOMIC_BENCH_DSN"],
            env["ATOMIC_BENCH_SCHEMA"],
        )
        return built
    raise AttributeError(name)
