"""Scenarios with real ``celery worker`` processes: kill, long, dbrestart, listenkill, poison."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from celery_pgqueue.bulk import send_many
from kombu_pgqueue._options import notify_channel

from . import ledger, procs
from .context import Context, Result, Run


def _publish_bulk(
    run: Run, app: Any, specs: list[tuple[str, tuple[Any, ...]]], batch: int = 5000
) -> threading.Thread:
    """Publish ``(task name, args)`` in COPY batches from a thread, recording each batch."""

    def go() -> None:
        with run.connect() as conn:
            for start in range(0, len(specs), batch):
                sigs = [
                    app.signature(name, args, task_id=str(uuid.uuid4()))
                    for name, args in specs[start : start + batch]
                ]
                report = send_many(app, sigs)
                ledger.record_published(conn, run.run_id, report.task_ids)

    thread = threading.Thread(target=go, name="publisher", daemon=True)
    thread.start()
    return thread


def _work_seconds(rng: random.Random) -> float:
    # mostly short tasks, some long enough that a kill often lands in the middle
    return rng.uniform(0.0, 0.01) if rng.random() < 0.95 else rng.uniform(0.2, 1.0)


def _wait_drained(
    run: Run,
    conn: psycopg.Connection,
    publisher: threading.Thread | None,
    timeout: float,
    tick: Any = None,
) -> bool:
    """Wait until the publisher is done and no message is left; ``tick()`` runs meanwhile."""
    deadline = time.monotonic() + timeout
    last_print = time.monotonic()
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        done_publishing = publisher is None or not publisher.is_alive()
        left = ledger.broker_leftovers(conn, run.schema)
        if done_publishing and left == 0:
            return True
        if time.monotonic() - last_print > 15:
            last_print = time.monotonic()
            print(
                f"    {run.elapsed():5.0f}s  finished {ledger.finished_count(conn, run.run_id)}"
                f"  messages left {left}"
            )
        procs.pause(0.5)
    return False


# -- 1. kill ------------------------------------------------------------------------------


def kill(ctx: Context) -> Result:
    n = ctx.tasks or (2000 if ctx.quick else 100_000)
    rng = random.Random(5)
    with ctx.run("kill") as run, run.connect() as conn:
        fleet = run.fleet(
            {"visibility_timeout": 10, "polling_interval": 2}, concurrency=3, prefetch=4
        )
        for _ in range(3):
            fleet.spawn()
        app = run.app()
        publisher = _publish_bulk(
            run, app, [("chaos.work", (_work_seconds(rng),)) for _ in range(n)]
        )
        kills = {"main": 0, "child": 0, "crashed": 0}
        next_kill = [time.monotonic() + rng.uniform(2, 5)]

        def tick() -> None:
            for worker in list(fleet.workers):
                if getattr(worker, "reaped", False) or not worker.broken():
                    continue
                worker.reaped = True  # type: ignore[attr-defined]
                worker.kill_group()
                ledger.record_event(conn, run.run_id, "crash", worker.name, worker.proc.pid)
                kills["crashed"] += 1
                print(f"    worker {worker.name} exited by itself:\n{worker.log_tail(1500)}")
                fleet.spawn()
            if time.monotonic() < next_kill[0]:
                return
            next_kill[0] = time.monotonic() + rng.uniform(2, 5)
            # only workers that are up: a pool child killed while billiard starts the
            # pool makes Celery give up ("Could not start worker processes")
            ready = {
                r[0]
                for r in conn.execute(
                    sql.SQL("SELECT worker FROM {} WHERE kind = 'ready'").format(
                        ledger.tables(run.run_id)["event"]
                    )
                )
            }
            live = [w for w in fleet.live() if w.name in ready]
            if not live:
                return
            worker = rng.choice(live)
            children = worker.children()
            if rng.random() < 0.3 or not children:
                os.kill(worker.proc.pid, signal.SIGKILL)
                at = _killed_at()
                ledger.record_event(conn, run.run_id, "main", worker.name, worker.proc.pid, at)
                procs.pause(1.0)  # the orphaned pool children run on a moment, then die too
                worker.kill_group()
                at = _killed_at()
                ledger.record_event(conn, run.run_id, "orphans", worker.name, worker.proc.pid, at)
                worker.reaped = True  # type: ignore[attr-defined]
                kills["main"] += 1
                fleet.spawn()
            else:
                pid = rng.choice(children)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    return
                ledger.record_event(conn, run.run_id, "child", worker.name, pid, _killed_at())
                kills["child"] += 1

        drained = _wait_drained(run, conn, publisher, timeout=max(600, n / 40), tick=tick)
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        result = Result(
            "kill", drained and fig.ok() and not kills["crashed"], fig, seconds=run.elapsed()
        )
        result.measures += [
            ("tasks", n),
            ("SIGKILLs of main processes", kills["main"]),
            ("SIGKILLs of pool children", kills["child"]),
            ("workers that exited by themselves", kills["crashed"]),
            ("workers started", fleet.started),
            ("drained (no message left)", drained),
        ]
        return result


# -- 2. long ------------------------------------------------------------------------------


def long(ctx: Context) -> Result:
    vt, seconds, n = 2.0, 10.0, 6
    with ctx.run("long") as run, run.connect() as conn:
        fleet = run.fleet(
            {"visibility_timeout": vt, "polling_interval": 0.5}, concurrency=3, prefetch=1
        )
        for _ in range(2):
            fleet.spawn()
        run.wait_ready(conn, 2)
        app = run.app()
        publisher = _publish_bulk(run, app, [("chaos.work", (seconds,))] * n)
        drained = _wait_drained(run, conn, publisher, timeout=120)
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        late_acks = sum("after its lease ended" in w.log_tail(10**6) for w in fleet.workers)
        ok = drained and fig.ok(allow_duplicates=False) and fig.executed == n and not late_acks
        result = Result("long", ok, fig, seconds=run.elapsed())
        result.measures += [
            ("visibility_timeout (s)", vt),
            ("task duration (s)", seconds),
            ("workers x processes", "2 x 3"),
            ("'ack after its lease ended' warnings", late_acks),
        ]
        return result


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
        procs.pg_restart()
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
        " WHERE l.locktype = 'advisory' AND l.classid = 1885827415 AND l.granted"
        " AND l.objid IN (SELECT ((hashtext(%s || ':' || q.name)::bigint + 4294967296)"
        " %% 4294967296)::oid FROM {}.queue AS q)"
    ).format(sql.Identifier(schema))
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


# -- 5. poison -----------------------------------------------------------------------------


def poison(ctx: Context) -> Result:
    n = ctx.tasks or 2000
    max_attempts = 3
    rng = random.Random(7)
    with ctx.run("poison") as run, run.connect() as conn:
        fleet = run.fleet(
            {"visibility_timeout": 30, "polling_interval": 2, "max_attempts": max_attempts},
            concurrency=2,
            prefetch=4,
        )
        for _ in range(2):
            fleet.spawn()
        specs: list[tuple[str, tuple[Any, ...]]] = [
            ("chaos.work", (rng.uniform(0, 0.01),)) for _ in range(n)
        ]
        for i, how in enumerate(("kill", "exit", "kill", "exit")):
            specs.insert((i + 1) * n // 5, ("chaos.poison", (how,)))
        app = run.app()
        publisher = _publish_bulk(run, app, specs)
        drained = _wait_drained(run, conn, publisher, timeout=max(300, n / 20))
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        dead = conn.execute(
            sql.SQL("SELECT headers->>'task', reason, attempts FROM {}").format(
                sql.Identifier(run.schema, "dead_letter")
            )
        ).fetchall()
        poisoned = [d for d in dead if d[0] == "chaos.poison"]
        ok = (
            drained
            and fig.lost == 0
            and fig.executed == n
            and len(poisoned) == 4
            and len(dead) == 4
            and all(d[1] == "max_attempts" and d[2] == max_attempts for d in poisoned)
            and all(w.alive() or w.proc.returncode in (0, -15) for w in fleet.workers)
        )
        result = Result("poison", ok, fig, seconds=run.elapsed())
        result.measures += [
            ("normal tasks", n),
            ("poison tasks (2 SIGKILL, 2 os._exit)", 4),
            ("dead letters (task, reason, attempts)", sorted(set(dead))),
            ("max_attempts", max_attempts),
            ("drained (no message left)", drained),
        ]
        return result


def _killed_at() -> datetime:
    """A kill's time in the ledger: this machine's clock (the local server's too) right
    after the signal. The server's clock at the event's INSERT can come later than the
    start of the killed task's next run elsewhere (as the atomic scenario found)."""
    return datetime.now(timezone.utc)
