"""Chaos scenario ``beat``: celery_pgqueue.beat on three nodes, the leader killed.

Three ``celery beat -S celery_pgqueue.beat:Scheduler`` processes and one entry every
second for 60 s (quick: 20 s; ``--minutes`` sets it). Every 10 s (quick: 5 s) the
leading beat is hit: two times in three SIGKILLed (a replacement starts once a
survivor leads), the third time its database session is terminated
(``pg_terminate_backend``: the process lives on and reconnects). Nothing consumes
the queue; each message carries its entry and due time in its headers, and the
scenario counts sends per due time.

Pass: every due second between the first and the last send sent exactly once, none
later than 5 s (docs/periodic-tasks.md: the takeover bound), no beat exiting by itself.
For contrast it then runs two beats of Celery's own ``PersistentScheduler`` for 10 s and
prints their sends per due second (2: every task twice).

The beats run ``celery -A benchmarks.chaos.beat beat``: the app below, built from
``CHAOS_DSN``, ``CHAOS_SCHEMA``, ``CHAOS_BEAT_NODE`` and ``CHAOS_BEAT_SCHEDULER``.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql

import celery_pgqueue
import kombu_pgqueue
from kombu_pgqueue import admin

from ..peers import drop_schema
from . import procs
from .context import Context, Result

OURS = "celery_pgqueue.beat:Scheduler"
CELERYS = "celery.beat:PersistentScheduler"
#: the documented bound on a due time's lateness after a kill
LATE_BOUND = 5.0


def make_beat_app(dsn: str, schema: str, node: str, scheduler: str) -> Celery:
    app = Celery("chaos_beat", set_as_current=False)
    celery_pgqueue.configure(app, dsn, results=False, schema=schema)
    app.conf.update(
        beat_scheduler=scheduler,
        beat_schedule={"tick": {"task": "chaos.beat_tick", "schedule": 1.0}},
        pgqueue_beat_node=node,
        task_ignore_result=True,
        result_expires=None,
    )
    return app


def __getattr__(name: str) -> Any:  # `celery -A benchmarks.chaos.beat` looks up `app`
    if name == "app":
        env = os.environ
        built = make_beat_app(
            env["CHAOS_DSN"],
            env["CHAOS_SCHEMA"],
            env["CHAOS_BEAT_NODE"],
            env["CHAOS_BEAT_SCHEDULER"],
        )
        globals()["app"] = built
        return built
    raise AttributeError(name)


class Beats:
    """The beat processes of one run."""

    def __init__(self, dsn: str, schema: str, logs: Path, scheduler: str) -> None:
        self.dsn, self.schema, self.logs, self.scheduler = dsn, schema, logs, scheduler
        self.alive: dict[str, procs.Worker] = {}
        self.count = 0

    def start(self) -> str:
        name = f"beat{self.count}"
        self.count += 1
        env = {
            **os.environ,
            "CHAOS_DSN": self.dsn,
            "CHAOS_SCHEMA": self.schema,
            "CHAOS_BEAT_NODE": name,
            "CHAOS_BEAT_SCHEDULER": self.scheduler,
        }
        log = self.logs / f"{self.schema}-{name}.log"
        state = self.logs / f"{self.schema}-{name}.db"
        args = ["-m", "celery", "-A", "benchmarks.chaos.beat", "beat", "-l", "info"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *args, "-s", str(state)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.alive[name] = procs.Worker(name, proc, log)
        return name

    def kill(self, name: str) -> None:
        worker = self.alive.pop(name)
        os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)

    def exited(self) -> list[str]:
        return [name for name, w in self.alive.items() if w.proc.poll() is not None]

    def stop(self) -> None:
        for name in list(self.alive):
            self.kill(name)


def _sends(conn: psycopg.Connection, schema: str) -> list[tuple[datetime, datetime]]:
    """(due time, stored at) of every periodic send."""
    query = sql.SQL(
        "SELECT (headers->>'pgqueue_beat_due')::timestamptz, created_at FROM {}"
        " WHERE headers->>'pgqueue_beat_entry' = 'tick' ORDER BY 1"
    ).format(sql.Identifier(schema, "message_store"))
    return [(due, stored) for due, stored in conn.execute(query).fetchall()]


def _ticks(conn: psycopg.Connection, schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {} WHERE headers->>'task' = 'chaos.beat_tick'")
    row = conn.execute(query.format(sql.Identifier(schema, "message_store"))).fetchone()
    return int(row[0]) if row else 0


def _now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def beat(ctx: Context) -> Result:
    seconds = ctx.minutes * 60 if ctx.minutes else (20.0 if ctx.quick else 60.0)
    every = 5.0 if ctx.quick else 10.0
    with ctx.run("beat") as run, run.connect() as conn:
        kombu_pgqueue.migrate(ctx.dsn, run.schema)
        broker = admin.Broker(ctx.dsn, schema=run.schema)
        beats = Beats(ctx.url_dsn, run.schema, ctx.logs, OURS)
        try:
            for _ in range(3):
                beats.start()
            procs.wait_for(lambda: _sends(conn, run.schema), 60, "the first send")
            began = time.monotonic()
            process_kills = session_kills = 0
            takeovers: list[float] = []
            while time.monotonic() - began < seconds:
                procs.pause(every)
                leader = procs.wait_for(broker.beat_leader, 30, "a leader")
                at = _now(conn)
                if (process_kills + session_kills) % 3 == 2:
                    conn.execute("SELECT pg_terminate_backend(%s)", (leader.backend_pid,))
                    session_kills += 1
                else:
                    beats.kill(leader.node)
                    process_kills += 1

                def taken(was: admin.Leader = leader) -> admin.Leader | None:
                    found = broker.beat_leader()
                    moved = found is not None and (found.backend_pid, found.since) != (
                        was.backend_pid,
                        was.since,
                    )
                    return found if moved else None

                new = procs.wait_for(taken, 30, "a beat to take the lead")
                takeovers.append((new.since - at).total_seconds())
                if len(beats.alive) < 3:
                    beats.start()
            exited = beats.exited()
        finally:
            beats.stop()
        sends = _sends(conn, run.schema)
        contrast = _celerys_own(ctx, run.schema + "_own", conn)
    per_due = Counter(due for due, _ in sends)
    dues = sorted(per_due)
    doubles = sum(1 for n in per_due.values() if n > 1)
    span = round((dues[-1] - dues[0]).total_seconds()) + 1 if dues else 0
    missing = span - len(dues)
    lateness = sorted((stored - due).total_seconds() for due, stored in sends)
    worst = lateness[-1] if lateness else 0.0
    passed = bool(sends) and not doubles and not missing and worst <= LATE_BOUND and not exited
    measures: list[tuple[str, Any]] = [
        ("due seconds", len(dues)),
        ("sends", len(sends)),
        ("due seconds sent more than once", doubles),
        ("due seconds never sent", missing),
        ("leader SIGKILLs / session terminations", f"{process_kills} / {session_kills}"),
        (
            "takeover, median / longest",
            f"{statistics.median(takeovers):.2f} / {max(takeovers):.2f} s",
        ),
        ("lateness, median / worst", f"{statistics.median(lateness):.3f} / {worst:.3f} s"),
        (f"sends later than {LATE_BOUND:g} s", sum(1 for x in lateness if x > LATE_BOUND)),
        ("beats that exited by themselves", len(exited)),
        ("Celery's PersistentScheduler, 2 beats: sends per due second", f"{contrast:.2f}"),
    ]
    return Result("beat", passed, measures=measures)


def _celerys_own(ctx: Context, schema: str, conn: psycopg.Connection) -> float:
    """Sends per due second of two beats of Celery's own scheduler, over 10 s."""
    kombu_pgqueue.migrate(ctx.dsn, schema)
    beats = Beats(ctx.url_dsn, schema, ctx.logs, CELERYS)
    try:
        beats.start()
        beats.start()
        procs.wait_for(lambda: _ticks(conn, schema) >= 2, 60, "the first sends")
        first, start = _ticks(conn, schema), time.monotonic()
        procs.pause(10.0)
        return (_ticks(conn, schema) - first) / (time.monotonic() - start)
    finally:
        beats.stop()
        if not ctx.keep:
            drop_schema(ctx.dsn, schema)
