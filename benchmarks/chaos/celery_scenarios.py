"""Scenarios with real ``celery worker`` processes: kill, long, poison (dbrestart and
listenkill: server_scenarios.py)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg import sql

from celery_pgqueue.bulk import send_many

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
