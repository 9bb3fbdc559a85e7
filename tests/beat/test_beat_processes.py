"""Real ``celery beat`` processes on one schema (issue 44): three beats, the leader
SIGKILLed again and again, and every due time sent exactly once, none late by more
than the documented bound.

The default run lasts :data:`SECONDS` (15 s, a kill every 5 s);
``PGQUEUE_BEAT_KILL_SECONDS=60`` runs the issue's minute (a kill every 10 s), as
``python -m benchmarks.chaos beat`` does with more kills.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from datetime import timedelta
from functools import partial
from pathlib import Path

import psycopg
import pytest
from celery_workers import Worker, Workers
from periodic_app import HERE, process_env, sent
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import admin
from kombu_pgqueue.schedule import Leader

SECONDS = float(os.environ.get("PGQUEUE_BEAT_KILL_SECONDS", "15"))
#: a kill every this many due seconds
KILL_EVERY = 10 if SECONDS >= 60 else 5
#: the documented bound on lateness after a kill (docs/periodic-tasks.md): the poll
#: interval (1 s), the dead session's end (at once on one host) and a tick, with room
#: for a loaded machine
LATE_BOUND = 5.0

pytestmark = [pytest.mark.celery, pytest.mark.slow]


def start_beat(
    beats: Workers, dsn: str, schema: str, name: str, tmp: Path, **settings: object
) -> Worker:
    env = process_env(dsn, schema, node=name, **settings)
    # Celery's own scheduler keeps its state in this file; ours ignores it
    args = ["-A", "periodic_app", "beat", "-l", "info", "-s", str(tmp / f"{name}.db")]
    return beats.run(name, args, cwd=HERE, env=env, log=f"beat-{name}.log")


@pytest.mark.parametrize("exclusive", [True, False], ids=["one-leads", "every-beat-sends"])
def test_three_beats_send_every_due_second_once_while_beats_are_killed(
    dsn: str,
    schema: str,
    periodic: object,
    broker: admin.Broker,
    db: psycopg.Connection,
    beats: Workers,
    tmp_path: Path,
    exclusive: bool,
) -> None:
    # one-leads: the leader is the one killed, and another takes over. every-beat-sends
    # (no lead, pgqueue_beat_exclusive off): three beats send at once, and the
    # transaction's guard alone keeps each due second to one send
    settings = {"every": 1, "exclusive": int(exclusive)}
    alive = {
        f"beat{n}": start_beat(beats, dsn, schema, f"beat{n}", tmp_path, **settings)
        for n in range(3)
    }

    def count() -> int:
        return len(sent(db, schema))

    def reached(target: int) -> bool:
        return count() >= target

    def other_leader(than: str) -> Leader | None:
        found = broker.beat_leader()
        return found if found is not None and found.node != than else None

    wait_for(count, 30, "the first send", *alive.values())
    kills, takeovers = 0, [0.0]
    while count() < SECONDS:
        target = count() + KILL_EVERY
        wait_for(partial(reached, target), KILL_EVERY + 10, f"{target} sends", *alive.values())
        leader = broker.beat_leader()
        assert (leader is not None) == exclusive
        victim = alive.pop(leader.node if leader else next(iter(alive)))
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        kills += 1
        if leader is not None:  # a survivor takes over, before the replacement starts
            new = wait_for(
                partial(other_leader, leader.node), 10, "another leader", *alive.values()
            )
            takeovers.append((new.since - killed_at).total_seconds())
        name = f"beat{2 + kills}"
        alive[name] = start_beat(beats, dsn, schema, name, tmp_path, **settings)
    sends = sent(db, schema)
    per_due = Counter(s.due for s in sends)
    doubles = {due.isoformat(): n for due, n in per_due.items() if n > 1}
    assert not doubles, f"sent more than once: {doubles}"
    dues = sorted(per_due)
    assert dues == [dues[0] + timedelta(seconds=k) for k in range(len(dues))], "a second unsent"
    late = sorted(((s.stored - s.due).total_seconds(), s.due.isoformat()) for s in sends)
    assert late[-1][0] <= LATE_BOUND, late[-5:]
    print(
        f"\n{len(sends)} due seconds, {kills} kills, worst lateness {late[-1][0]:.2f}s, "
        f"longest takeover {max(takeovers):.2f}s"
    )


def test_celerys_own_scheduler_sends_every_due_time_twice_from_two_beats(
    dsn: str, schema: str, periodic: object, db: psycopg.Connection, beats: Workers, tmp_path: Path
) -> None:
    # what the test above guards against: two beats of Celery's default scheduler
    own = {"every": 1, "scheduler": "celery.beat:PersistentScheduler"}
    started = [start_beat(beats, dsn, schema, f"own{n}", tmp_path, **own) for n in range(2)]
    table = sql.Identifier(schema, "message_store")

    def ticks() -> int:
        query = sql.SQL("SELECT count(*) FROM {} WHERE headers->>'task' = 'periodic.tick'")
        row = db.execute(query.format(table)).fetchone()
        return int(row[0]) if row else 0

    wait_for(lambda: ticks() >= 1, 30, "the first send", *started)
    first = db.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
    wait_for(lambda: ticks() >= 12, 30, "12 sends", *started)
    elapsed = (db.execute("SELECT clock_timestamp()").fetchone()[0] - first).total_seconds()  # type: ignore[index]
    # one send per second would take 11 s; two beats take about half of that
    assert elapsed < 8.0, f"12 sends in {elapsed:.1f}s: not duplicated?"


def test_a_worker_with_embedded_beat_leads_and_sends(
    dsn: str, schema: str, periodic: object, broker: admin.Broker, db: psycopg.Connection,
    beats: Workers, tmp_path: Path,
) -> None:  # fmt: skip
    # `celery worker -B`: the scheduler runs in the worker's beat thread; the app's
    # beat_scheduler names it, as `--scheduler` would
    worker = beats.run(
        "worker", ["-A", "periodic_app", "worker", "-B", "-Q", "unused", "-c", "1", "-l", "info",
                   "-s", str(tmp_path / "w.db"), "--without-mingle", "--without-gossip"],
        cwd=HERE, env=process_env(dsn, schema, node="embedded", every=0.5),
    )  # fmt: skip
    leader = wait_for(broker.beat_leader, 60, "the embedded beat to lead", worker)
    assert leader.node == "embedded"
    wait_for(lambda: len(sent(db, schema)) >= 3, 30, "three sends", worker)
    [entry] = broker.periodic_entries()
    assert (entry.name, entry.origin, entry.total_run_count >= 3) == ("tick", "config", True)
