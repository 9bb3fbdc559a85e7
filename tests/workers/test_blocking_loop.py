"""A worker whose event loop runs its tasks (Celery's solo pool) takes no handoffs.

A publish hands a message to a worker that waits for the queue (docs/lifecycle.md,
"Handoff"). A solo worker runs each task inside its event loop, so while one runs it
reads nothing: a message handed to it then waits behind that task while other workers
idle. Such a worker registers as no waiter: it is woken, and claims, like any consumer
once its loop is back; a waiting worker of another pool gets the handoff.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import open_gate
from psycopg import sql
from waiting import wait_for

pytestmark = pytest.mark.celery

#: long enough that a message handed to a busy solo worker stays its own for the test
VISIBILITY = 600


@pytest.fixture
def lifecycle_options() -> dict[str, Any]:
    return {"visibility_timeout": VISIBILITY}


def finished(db: psycopg.Connection, schema: str, label: str) -> str | None:
    """The hostname that ran task ``label`` to its end, or None."""
    row = db.execute(
        sql.SQL("SELECT hostname FROM {} WHERE label = %s AND finished_at IS NOT NULL").format(
            sql.Identifier(schema, "ledger")
        ),
        (label,),
    ).fetchone()
    return None if row is None else str(row[0])


def test_a_solo_worker_running_a_task_is_handed_nothing(spawn, publisher, db, schema):
    # prefetch 4: the solo worker's window has room while its one task runs, so it
    # waits for its queues all that time
    solo = spawn("solo", pool="solo", concurrency=1, queues="slow,celery", prefetch=4)
    other = spawn("other", pool="prefork", concurrency=1, queues="celery")
    wait_for(
        lambda: solo.says(" ready.") and other.says(" ready."),
        30,
        "both workers ready",
        solo,
        other,
    )
    publisher.send_task("lifecycle.block", ("slow", "gate"), queue="slow")
    started = sql.SQL("SELECT hostname FROM {} WHERE label = 'slow'").format(
        sql.Identifier(schema, "ledger")
    )
    wait_for(lambda: db.execute(started).fetchone(), 30, "the solo worker to start its task", solo)

    # one at a time, each with both workers waiting: a handoff picks either; one handed
    # to the solo worker would wait behind its task (the gate stays shut throughout)
    for i in range(16):
        publisher.send_task("lifecycle.work", (f"work{i}",), queue="celery")
        host = wait_for(
            lambda i=i: finished(db, schema, f"work{i}"),
            30,
            f"work{i} to run while the solo worker's loop runs a task",
            other,
        )
        assert host.startswith("other@"), host

    assert finished(db, schema, "slow") is None
    open_gate(db, schema, "gate", table="ledger_gate")
    wait_for(lambda: finished(db, schema, "slow"), 30, "the solo worker's task to end", solo)
    assert "handoffs off" in solo.log()
    assert "Traceback" not in solo.log() + other.log()
