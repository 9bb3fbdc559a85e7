"""Scenarios with real ``celery worker`` processes: kill, handoff, long, poison
(dbrestart and listenkill: server_scenarios.py)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
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


# -- 1. kill, and handoff: the same workers and kills, two ways of publishing -----------

#: the workers' transport options under kills: a held message comes back after 10 s
KILL_OPTIONS = {"visibility_timeout": 10, "polling_interval": 2}


class Killer:
    """Every ``every`` seconds (at random within), SIGKILL a random ready worker's pool
    child (70 %) or its main process (30 %; then its orphaned pool children a second
    later, and a new worker is started). A worker that exits by itself (or logs Celery's
    "Unrecoverable error") is recorded as a crash and replaced. Every kill is a ledger
    event. Call :meth:`tick` often (``_wait_drained`` does)."""

    def __init__(
        self,
        run: Run,
        conn: psycopg.Connection,
        fleet: procs.Fleet,
        rng: random.Random,
        every: tuple[float, float] = (2.0, 5.0),
    ) -> None:
        self.run, self.conn, self.fleet, self.rng, self.every = run, conn, fleet, rng, every
        self.counts = {"main": 0, "child": 0, "crashed": 0}
        self.next_kill = time.monotonic() + rng.uniform(*every)

    def tick(self) -> None:
        run_id = self.run.run_id
        for worker in list(self.fleet.workers):
            if getattr(worker, "reaped", False) or not worker.broken():
                continue
            worker.reaped = True  # type: ignore[attr-defined]
            worker.kill_group()
            ledger.record_event(self.conn, run_id, "crash", worker.name, worker.proc.pid)
            self.counts["crashed"] += 1
            print(f"    worker {worker.name} exited by itself:\n{worker.log_tail(1500)}")
            self.fleet.spawn()
        if time.monotonic() < self.next_kill:
            return
        self.next_kill = time.monotonic() + self.rng.uniform(*self.every)
        # only workers that are up: a pool child killed while billiard starts the pool
        # makes Celery give up ("Could not start worker processes")
        ready = {
            r[0]
            for r in self.conn.execute(
                sql.SQL("SELECT worker FROM {} WHERE kind = 'ready'").format(
                    ledger.tables(run_id)["event"]
                )
            )
        }
        live = [w for w in self.fleet.live() if w.name in ready]
        if not live:
            return
        worker = self.rng.choice(live)
        children = worker.children()
        if self.rng.random() < 0.3 or not children:
            os.kill(worker.proc.pid, signal.SIGKILL)
            at = _killed_at()
            ledger.record_event(self.conn, run_id, "main", worker.name, worker.proc.pid, at)
            procs.pause(1.0)  # the orphaned pool children run on a moment, then die too
            worker.kill_group()
            at = _killed_at()
            ledger.record_event(self.conn, run_id, "orphans", worker.name, worker.proc.pid, at)
            worker.reaped = True  # type: ignore[attr-defined]
            self.counts["main"] += 1
            self.fleet.spawn()
            return
        pid = self.rng.choice(children)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        ledger.record_event(self.conn, run_id, "child", worker.name, pid, _killed_at())
        self.counts["child"] += 1


def _under_kills(
    ctx: Context,
    name: str,
    n: int,
    rng: random.Random,
    publish: Callable[[Run, psycopg.Connection], Any],
    timeout: float,
    wait_ready: bool = False,
    options: dict[str, Any] = KILL_OPTIONS,
) -> Result:
    """3 prefork workers x 3 processes (prefetch 4, ``acks_late``, transport
    ``options``) run ``chaos.work`` while a :class:`Killer` kills; ``publish(run,
    conn)`` starts the publishing and returns something with ``is_alive()``. Passed:
    drained, the ledger's criteria (0 lost, no overlap, every duplicate explained), no
    worker exited by itself."""
    with ctx.run(name) as run, run.connect() as conn:
        fleet = run.fleet(options, concurrency=3, prefetch=4)
        for _ in range(3):
            fleet.spawn()
        if wait_ready:
            run.wait_ready(conn, 3)
        publisher = publish(run, conn)
        killer = Killer(run, conn, fleet, rng)
        drained = _wait_drained(run, conn, publisher, timeout=timeout, tick=killer.tick)
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        passed = drained and fig.ok() and not killer.counts["crashed"]
        result = Result(name, passed, fig, seconds=run.elapsed())
        result.measures += [
            ("tasks", n),
            ("SIGKILLs of main processes", killer.counts["main"]),
            ("SIGKILLs of pool children", killer.counts["child"]),
            ("workers that exited by themselves", killer.counts["crashed"]),
            ("workers started", fleet.started),
            ("drained (no message left)", drained),
        ]
        return result


def kill(ctx: Context) -> Result:
    """Tasks published by COPY (``send_many``) into a backlog while workers are killed."""
    n = ctx.tasks or (2000 if ctx.quick else 100_000)
    rng = random.Random(5)
    specs: list[tuple[str, tuple[Any, ...]]] = [
        ("chaos.work", (_work_seconds(rng),)) for _ in range(n)
    ]
    return _under_kills(
        ctx,
        "kill",
        n,
        rng,
        lambda run, conn: _publish_bulk(run, run.app(), specs),
        timeout=max(600, n / 40),
    )


#: handoff: total publish rate (tasks/s, all producers): below what the workers drain,
#: so that they mostly wait and publishes are handed off (CHAOS_HANDOFF_RATE)
HANDOFF_RATE = float(os.environ.get("CHAOS_HANDOFF_RATE", "100"))
HANDOFF_PRODUCERS = 3
#: handoff passes only if at least this share of first executions came by handoff
HANDOFF_MIN_SHARE = 0.5


def _send_one_by_one(
    dsn: str, schema: str, run_id: str, count: int, rate: float, seed: int
) -> None:
    """A producer process: ``count`` ``chaos.work`` tasks, one ``send_task`` each, at
    ``rate``/s (a late one is not made up for with a burst); each id is written to the
    ledger once its publish returned (in batches of 50, and at the end)."""
    from .app import make_app

    app = make_app(dsn, schema, run_id, dict(KILL_OPTIONS), 1)
    rng = random.Random(seed)
    believed: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        due = time.monotonic()
        for _ in range(count):
            procs.pause(due - time.monotonic())
            due = max(due, time.monotonic()) + 1.0 / rate
            task_id = str(uuid.uuid4())
            app.send_task("chaos.work", (_work_seconds(rng),), task_id=task_id)
            believed.append(task_id)
            if len(believed) >= 50:
                ledger.record_published(conn, run_id, believed)
                believed = []
        ledger.record_published(conn, run_id, believed)
    app.close()


class _Producers:
    """Producer processes, alive while any of them is."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes
        for p in processes:
            p.start()

    def is_alive(self) -> bool:
        return any(p.is_alive() for p in self.processes)

    def failed(self) -> list[int | None]:
        """Exit codes of those that did not end well (None: still running)."""
        return [p.exitcode for p in self.processes if p.exitcode != 0]


def _one_by_one_under_kills(
    ctx: Context, name: str, n: int, seed: int, options: dict[str, Any]
) -> Result:
    """kill's workers (transport ``options``) and kills, the tasks sent one by one
    (``send_task``) by producer processes at a rate the workers keep up with: they
    mostly wait for news."""
    rng = random.Random(seed)
    mp = multiprocessing.get_context("spawn")
    share = n // HANDOFF_PRODUCERS
    counts = [share + (i < n - share * HANDOFF_PRODUCERS) for i in range(HANDOFF_PRODUCERS)]
    rate = HANDOFF_RATE / HANDOFF_PRODUCERS
    producers: list[_Producers] = []

    def publish(run: Run, conn: psycopg.Connection) -> _Producers:
        args = (ctx.dsn, run.schema, run.run_id)
        processes = [
            mp.Process(target=_send_one_by_one, args=(*args, k, rate, 100 + i), daemon=True)
            for i, k in enumerate(counts)
        ]
        producers.append(_Producers(processes))
        return producers[0]

    try:
        result = _under_kills(
            ctx,
            name,
            n,
            rng,
            publish,
            timeout=n / HANDOFF_RATE + 600,
            wait_ready=True,
            options=options,
        )
    finally:
        for p in producers[0].processes if producers else []:
            p.join(timeout=5)
            if p.is_alive():  # not done when the drain timed out: it must not go on
                p.terminate()
    failed = producers[0].failed() if producers else []
    fig = result.figures
    assert fig is not None
    if failed:
        result.passed = False
        result.notes.append(f"producer processes exited with {failed}")
    if fig.published != n:
        result.passed = False
        result.notes.append(f"{fig.published} of {n} publishes were written down")
    result.measures[1:1] = [
        ("producers x tasks, one send_task each", f"{HANDOFF_PRODUCERS} x {counts[0]}"),
        ("publish rate (tasks/s, all producers)", HANDOFF_RATE),
    ]
    return result


def handoff(ctx: Context) -> Result:
    """Tasks sent one by one while workers are killed: most publishes lease the message
    to a waiting worker (a handoff) rather than queue it."""
    n = ctx.tasks or (2000 if ctx.quick else 20_000)
    result = _one_by_one_under_kills(ctx, "handoff", n, 13, KILL_OPTIONS)
    fig = result.figures
    assert fig is not None
    handed = fig.handoff_share()
    if handed < HANDOFF_MIN_SHARE:
        result.passed = False
        result.notes.append(
            f"only {handed:.1%} of first executions came by handoff (at least "
            f"{HANDOFF_MIN_SHARE:.0%} wanted): the handoff path was not what ran; publish "
            "slower (CHAOS_HANDOFF_RATE)"
        )
    return result


def relay(ctx: Context) -> Result:
    """handoff's tasks and kills, the workers relayed (transport option ``relay``): the
    host's one LISTEN session is the hub worker's, and a main process killed is the
    hub's a third of the time; its clients join a new hub (on the same connection)
    and claim from every queue once. Nothing may be lost or run twice unexplained."""
    n = ctx.tasks or (2000 if ctx.quick else 20_000)
    return _one_by_one_under_kills(ctx, "relay", n, 17, {**KILL_OPTIONS, "relay": True})


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
