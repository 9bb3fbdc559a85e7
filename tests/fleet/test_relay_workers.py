"""Celery workers through the host's relay (transport option ``relay``, issue 43): tasks
run, remote control reaches every worker, a killed hub's worker is replaced as the hub,
and idle workers hold one LISTEN session between them."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from celery_workers import Worker
from fleet_app import make_app
from held_sessions import Sessions, process_tree
from held_sessions import listening as waiting_sessions
from waiting import wait_for

RELAYED = {"relay": True, "polling_interval": 60, "pool_max_idle": 1}


def _names(workers: list[Worker]) -> list[str]:
    return [f"pgqueue[{pid}]" for w in workers for pid in process_tree(w.proc.pid)]


def listening(db: psycopg.Connection, workers: list[Worker]) -> int:
    """The workers' LISTEN sessions (see held_sessions)."""
    return waiting_sessions(db, _names(workers))


def test_workers_through_the_relay_run_tasks_and_answer_remote_control(
    fleet_worker: Callable[..., Worker],
    sessions: Sessions,
    db: psycopg.Connection,
    dsn: str,
    schema: str,
) -> None:
    workers = [fleet_worker(pool="prefork", concurrency=2, **RELAYED) for _ in range(3)]
    app = make_app(dsn, schema)
    try:
        results = [app.tasks["fleet.add"].delay(i, i) for i in range(20)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(20)]
        replies = app.control.inspect(timeout=5).ping() or {}
        assert len(replies) == 3, replies
        wait_for(lambda: listening(db, workers) == 1, 30, "one LISTEN session for 3 workers")
        # the hub's worker: its LISTEN session and pool; the others none once idle
        wait_for(
            lambda: sum(len(sessions.of(w.proc.pid)) for w in workers) <= 4,
            30,
            "the idle workers to hold at most 4 sessions in all",
            *workers,
            details=lambda: [sessions.of(w.proc.pid) for w in workers],
        )
        # the hub's worker dies (the first to start): another worker becomes the hub,
        # and tasks and remote control go on
        workers[0].kill()
        results = [app.tasks["fleet.add"].delay(i, 1) for i in range(10)]
        assert [r.get(timeout=60) for r in results] == [i + 1 for i in range(10)]
        replies = app.control.inspect(timeout=5).ping() or {}
        assert len(replies) == 2, replies
        wait_for(lambda: listening(db, workers[1:]) == 1, 30, "one LISTEN session again")
        # they joined the new hub on their connection: no reconnect, which would have
        # handed back (and run twice) what their pools were running
        for worker in workers[1:]:
            assert not worker.says("Connection to broker lost"), worker.log()
    finally:
        app.close()
