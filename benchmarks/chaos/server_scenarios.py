"""Scenarios where the server side fails under real ``celery worker`` processes:
dbrestart (the broker's own throwaway cluster restarts) and listenkill (the workers'
LISTEN sessions are terminated)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from kombu_pgqueue._options import notify_channel
from kombu_pgqueue._sql import LOCKS

from . import ledger, procs
from .celery_scenarios import _wait_drained
from .context import Context, Result

# the cluster helper lives with the tests; dbrestart restarts one of its own
sys.path.insert(0, str(procs.ROOT / "tests"))
from clusters import Cluster  # noqa: E402

# -- 3. dbrestart --------------------------------------------------------------------------


def _producer(dsn: str, schema: str, run_id: str, count: int, ids_path: str) -> None:
    """Send ``count`` tasks one by one, retrying on errors; write down each success."""
    from .app import make_app

    app = make_app(dsn, schema, run_id, {"visibility_timeout": 10}, 1)
    policy = {"max_retries": 60, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2}
    with open(ids_path, "w") as out:
        for _ in range(count):
            task_id = str(uuid.uuid4())
            for attempt in range(120):
                try:
                    app.send_task(
                        "chaos.work", (0.0,), task_id=task_id, retry=True, retry_policy=policy
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - retried, then given up on
                    if attempt == 0:
                        print(
                            f"    producer {os.getpid()}: publish failed "
                            f"({type(exc).__name__}: {exc}); retrying"
                        )
                    threading.Event().wait(0.5)
            else:
                continue  # never believed published: not written down
            out.write(task_id + "\n")
            out.flush()
    app.close()


def _safe(query: Any, default: Any = None) -> Any:
    try:
        return query()
    except psycopg.OperationalError:
        return default


def dbrestart(ctx: Context) -> Result:
    """Restart the broker's server while workers consume and producers publish: a
    throwaway cluster of the scenario's own (``tests/clusters.py``), which also holds the
    ledger, never the shared server."""
    with Cluster.primary(name="chaos-dbrestart") as cluster:
        return _dbrestart(dataclasses.replace(ctx, dsn=cluster.dsn, url_dsn=cluster.dsn), cluster)


def _dbrestart(ctx: Context, cluster: Cluster) -> Result:
    n = ctx.tasks or (2000 if ctx.quick else 50_000)
    producers = 2
    mp = multiprocessing.get_context("spawn")
    with ctx.run("dbrestart") as run:
        fleet = run.fleet(
            {"visibility_timeout": 10, "polling_interval": 2}, concurrency=3, prefetch=4
        )
        for _ in range(3):
            fleet.spawn()
        with run.connect() as conn:
            run.wait_ready(conn, 3)
        fleet.supervise()
        paths = [ctx.logs / f"{run.run_id}-producer{i}.ids" for i in range(producers)]
        procs_ = [
            mp.Process(
                target=_producer, args=(ctx.dsn, run.schema, run.run_id, n // producers, str(p))
            )
            for p in paths
        ]
        for p in procs_:
            p.start()

        def finished() -> int:
            with run.connect() as c:
                return ledger.finished_count(c, run.run_id)

        procs.wait_for(
            lambda: _safe(finished, 0) >= n * 0.25, 600, "a quarter of the tasks to run", every=0.5
        )
        down_at = time.time()
        before = finished()
        cluster.stop("fast")
        cluster.start()
        with run.connect() as conn:
            up_at = conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
            ledger.record_event(conn, run.run_id, "dbrestart", at=up_at)
        print(
            f"    restarted PostgreSQL: down {up_at.timestamp() - down_at:.1f} s; "
            f"{before} tasks had finished"
        )

        def started_after(k: int) -> Any:
            with run.connect() as c:
                row = c.execute(
                    sql.SQL(
                        "SELECT started_at FROM {} WHERE started_at > %s "
                        "ORDER BY started_at OFFSET %s LIMIT 1"
                    ).format(ledger.tables(run.run_id)["exec"]),
                    (up_at, k - 1),
                ).fetchone()
                return row[0] if row else None

        first = procs.wait_for(
            lambda: _safe(lambda: started_after(1)), 300, "a task to start after the restart"
        )
        hundredth = procs.wait_for(
            lambda: _safe(lambda: started_after(100)), 300, "100 tasks after the restart"
        )
        for p in procs_:
            p.join(timeout=1800)
        believed: list[str] = []
        for path in paths:
            believed += Path(path).read_text().split()
        with run.connect() as conn:
            ledger.record_published(conn, run.run_id, believed)
            drained = _wait_drained(run, conn, None, timeout=600)
            fleet.stop()
            fig = ledger.analyse(conn, run.run_id, run.schema)
        crashed = len(fleet.crashed)
        ok = drained and fig.lost == 0 and fig.overlapping == 0 and not crashed
        result = Result("dbrestart", ok, fig, seconds=run.elapsed())
        for worker in fleet.crashed:
            lines = [
                x
                for x in worker.log_tail(20000).splitlines()
                if "Unrecoverable" in x or "Error" in x
            ]
            result.notes.append(
                f"worker {worker.name} exited ({worker.proc.returncode}): "
                f"{lines[-1] if lines else '?'}"
            )
        result.measures += [
            ("tasks sent (producers x tasks)", f"{producers} x {n // producers}"),
            ("publishes believed successful", len(believed)),
            (
                "server down (restart command to postmaster start)",
                f"{up_at.timestamp() - down_at:.1f} s",
            ),
            (
                "first task start after the server was back",
                f"{(first - up_at).total_seconds():.1f} s",
            ),
            (
                "100th task start after the server was back",
                f"{(hundredth - up_at).total_seconds():.1f} s",
            ),
            ("workers that crashed (restarted as a supervisor would)", crashed),
            ("drained (no message left)", drained),
        ]
        return result


# -- 4. listenkill -------------------------------------------------------------------------


def _listeners(conn: psycopg.Connection, schema: str) -> list[int]:
    """The workers' listening sessions: they hold the watch locks of the schema's queues
    (see the top of kombu_pgqueue/sql/queries.sql)."""
    channel = notify_channel(schema)
    watched = sql.SQL(
        "SELECT DISTINCT l.pid FROM pg_locks AS l"
        " WHERE l.locktype = 'advisory' AND l.classid = {lock} AND l.granted"
        " AND l.objid IN (SELECT ((hashtext(%s || ':' || q.name)::bigint + 4294967296)"
        " %% 4294967296)::oid FROM {schema}.queue AS q)"
    ).format(schema=sql.Identifier(schema), lock=sql.Literal(LOCKS["lock_waiting"]))
    return [r[0] for r in conn.execute(watched, (channel,))]


def listenkill(ctx: Context) -> Result:
    polling = 30.0
    with ctx.run("listenkill") as run, run.connect() as conn:
        fleet = run.fleet(
            {"visibility_timeout": 10, "polling_interval": polling}, concurrency=2, prefetch=1
        )
        fleet.spawn()
        run.wait_ready(conn, 1)
        app = run.app()
        exec_table = ledger.tables(run.run_id)["exec"]

        def latency() -> float:
            task_id = str(uuid.uuid4())
            sent = time.monotonic()
            app.send_task("chaos.work", (0.0,), task_id=task_id)
            ledger.record_published(conn, run.run_id, [task_id])
            procs.wait_for(
                lambda: ledger.count(
                    conn,
                    sql.SQL("SELECT count(*) FROM {} WHERE task_id = %s").format(exec_table),
                    (task_id,),
                ),
                polling * 2 + 10,
                "the task to start",
                every=0.05,
            )
            return time.monotonic() - sent

        procs.wait_for(lambda: _listeners(conn, run.schema), 30, "the worker's LISTEN connection")
        baseline = latency()
        rows: list[tuple[str, Any]] = [
            ("polling_interval (s)", polling),
            ("latency before any kill", f"{baseline:.2f} s"),
        ]
        worst = 0.0
        for round_, idle in enumerate((0.0, 3.0, 0.0), 1):
            pids = procs.wait_for(lambda: _listeners(conn, run.schema), 60, "a LISTEN connection")
            conn.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
            # the worker loses its broker connection: a task it runs then (acks_late) is
            # delivered again, as on any broker, and that duplicate is explained by this
            ledger.record_event(conn, run.run_id, "dbrestart", "listenkill")
            killed = time.monotonic()
            procs.pause(idle)
            took = latency()
            relisten = procs.wait_for(lambda: _listeners(conn, run.schema), 60, "LISTEN again")
            worst = max(worst, took)
            rows.append(
                (
                    f"round {round_}: terminated {len(pids)} LISTEN backend(s), "
                    f"idle {idle:.0f} s, then published",
                    f"task started {took:.2f} s after publish; LISTEN back ({len(relisten)}) "
                    f"{time.monotonic() - killed:.1f} s after the kill",
                )
            )
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        result = Result("listenkill", fig.ok() and worst < 10.0, fig, rows, seconds=run.elapsed())
        return result
