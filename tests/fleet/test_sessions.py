"""How many server sessions a process holds (issue 43): a publishing process with many
threads, and Celery workers idle and busy, of each pool. A managed server allows 100 to
500, shared with the application: twenty workers and ten web processes must fit.
docs/operations.md, "Connections", has the table these figures are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import psycopg
import pytest
from celery_workers import Worker
from fleet_app import make_app
from held_sessions import Sessions
from psycopg import sql
from waiting import wait_for


def _stored(db: psycopg.Connection, schema: str) -> int:
    row = db.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE queue = 'fleet'").format(
            sql.Identifier(schema, "message_store")
        )
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_publisher_of_many_threads_holds_two_sessions_and_none_once_idle(
    publishing: Callable[..., Popen[str]], sessions: Sessions, db: psycopg.Connection, schema: str
) -> None:
    proc = publishing(8, 50, pool_max_idle=1)
    held = sessions.of(proc.pid)
    assert 1 <= len(held) <= 2, held
    assert _stored(db, schema) == 400
    # closed once idle for pool_max_idle (the pool closes one idle session a period)
    wait_for(lambda: not sessions.of(proc.pid), 30, "the publisher's sessions to close")


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_holds_two_sessions_idle_and_three_busy(
    fleet_worker: Callable[..., Worker],
    sessions: Sessions,
    dsn: str,
    schema: str,
    tmp_path: Path,
    pool: str,
) -> None:
    worker = fleet_worker(pool=pool, concurrency=8, pool_max_idle=1)
    app = make_app(dsn, schema)
    try:
        # a few tasks first: each pool child has stored a result
        assert [
            r.get(timeout=60) for r in [app.tasks["fleet.add"].delay(i, i) for i in range(16)]
        ] == [2 * i for i in range(16)]
        wait_for(
            lambda: len(sessions.of(worker.proc.pid)) <= 2,
            30,
            "an idle worker to hold at most 2 sessions",
            worker,
            details=lambda: sessions.of(worker.proc.pid),
        )
        # busy: every child runs a task that waits for the gate
        gate = tmp_path / "gate"
        held = [app.tasks["fleet.hold"].delay(str(gate)) for _ in range(8)]
        wait_for(
            lambda: worker.says("fleet.hold") and True,
            30,
            "the tasks to start",
            worker,
        )
        busy = sessions.of(worker.proc.pid)
        assert len(busy) <= 3, busy
        gate.touch()
        assert [r.get(timeout=60) for r in held] == ["gate"] * 8
        # the children stored their results: a session each for that, no more, until
        # they have been idle for pool_max_idle; the broker's stay within 3
        after = sessions.of(worker.proc.pid)
        broker = [name for name in after if name.startswith("pgqueue[")]
        assert len(broker) <= 3, after
        assert len(after) - len(broker) <= 8, after
        wait_for(
            lambda: len(sessions.of(worker.proc.pid)) <= 2,
            30,
            "the worker to hold at most 2 sessions once idle again",
            worker,
            details=lambda: sessions.of(worker.proc.pid),
        )
    finally:
        app.close()
