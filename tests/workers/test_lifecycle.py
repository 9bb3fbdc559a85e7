"""Worker lifecycle with real ``celery worker`` processes: crashes, long tasks, poison
tasks and warm shutdown.

Each task writes its start and end to a ledger table (see ``lifecycle_app``), so the
assertions count executions exactly instead of trusting results or logs.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery_workers import Worker
from helpers import open_gate
from ledger import runs
from psycopg import sql
from psycopg.rows import dict_row
from waiting import wait_for

from kombu_pgqueue.admin import Broker

pytestmark = pytest.mark.celery


def messages(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    """The broker's message rows, with the task id and whether a live lease holds them."""
    with db.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL(
                """
                SELECT id, queue, headers->>'id' AS task_id, attempts, lease, next_iteration,
                       lease IS NOT NULL AND next_iteration > clock_timestamp() AS leased,
                       NOT delayed AND lease IS NULL
                           AND next_iteration <= clock_timestamp() AS ready
                FROM {}
                ORDER BY id
                """
            ).format(sql.Identifier(schema, "message_store"))
        ).fetchall()


def dead_letters(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    with db.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL(
                "SELECT id, queue, headers->>'id' AS task_id, attempts, reason FROM {} ORDER BY id"
            ).format(sql.Identifier(schema, "dead_letter"))
        ).fetchall()


def by_task(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(row["task_id"], []).append(row)
    return found


def on(row: dict[str, Any], worker: Worker) -> bool:
    return bool(row["hostname"].startswith(f"{worker.name}@"))


def test_sigkilled_worker_loses_nothing(spawn, publisher, db, schema):
    ids = [publisher.send_task("lifecycle.block", (f"job{i}", "open")).id for i in range(6)]
    settings = {"concurrency": 2, "prefetch": 2, "visibility_timeout": 3}
    a = spawn("a", **settings)
    # two tasks running, two more prefetched: four leases held by worker a
    wait_for(
        lambda: len(runs(db, schema)) == 2 and sum(m["leased"] for m in messages(db, schema)) == 4,
        30,
        "worker a to run 2 tasks and hold 4",
        a,
    )

    a.kill()
    rows = messages(db, schema)
    lease_end = {m["task_id"]: m["next_iteration"] for m in rows if m["lease"] is not None}
    assert len(rows) == 6, rows
    # nothing comes back before its lease ends
    assert [m["task_id"] for m in rows if m["leased"]] == list(lease_end)
    assert len(lease_end) == 4

    open_gate(db, schema, "open", table="ledger_gate")
    b = spawn("b", **settings)
    wait_for(
        lambda: (
            not messages(db, schema)
            and sum(r["finished_at"] is not None for r in runs(db, schema)) == 6
        ),
        30,
        "worker b to run all 6 tasks",
        b,
    )

    executions = by_task(runs(db, schema))
    assert set(executions) == set(ids)
    for task_id, task_runs in executions.items():
        finished = [r for r in task_runs if r["finished_at"] is not None]
        assert len(finished) == 1 and on(finished[0], b), task_runs
        on_a = [r for r in task_runs if on(r, a)]
        assert all(r["finished_at"] is None for r in on_a), task_runs
        if task_id in lease_end:
            # worker b had it only once worker a's lease had ended
            assert [r["started_at"] >= lease_end[task_id] for r in task_runs if on(r, b)] == [
                True
            ], (task_runs, lease_end[task_id])
    assert sum(len(v) for v in executions.values()) == 8  # 2 cut short on a, 6 on b
    assert dead_letters(db, schema) == []
    assert "Traceback" not in b.log()


def test_task_longer_than_visibility_timeout_runs_once(spawn, publisher, db, schema):
    visibility = 2
    settings = {"concurrency": 2, "visibility_timeout": visibility, "lease_renewal_interval": 0.5}
    a = spawn("a", **settings)
    b = spawn("b", **settings)
    # both consume, each with a free process to take a lapsed lease
    wait_for(lambda: a.says(" ready.") and b.says(" ready."), 30, "workers a and b ready", a, b)

    task_id = publisher.send_task("lifecycle.block", ("long", "long")).id
    seen: list[dict[str, Any]] = []

    def renewed_past(periods: int) -> bool:
        """The running task's lease was renewed to end ``periods`` leases after it started."""
        # the ledger first: rows read once the task has started show the lease it runs
        # under (before it, a handoff read late is handed back and claimed again under
        # a new lease, without an attempt counted: not a second delivery)
        ledger = runs(db, schema)
        rows = messages(db, schema)
        if ledger:
            seen.extend(rows)
        return bool(
            rows
            and ledger
            and rows[0]["next_iteration"] - ledger[0]["started_at"]
            >= timedelta(seconds=periods * visibility)
        )

    # the lease of a 2 s visibility timeout, renewed past four of them: the task has run
    # three visibility timeouts (and more) with nobody else taking it
    wait_for(lambda: renewed_past(4), 30, "the running task's lease renewed past 4 periods", a, b)
    open_gate(db, schema, "long", table="ledger_gate")

    def done() -> bool:
        ledger = runs(db, schema)
        rows = messages(db, schema)
        seen.extend(rows)
        return not rows and len(ledger) >= 1 and ledger[0]["finished_at"] is not None

    wait_for(done, 30, "the long task to finish and be acked", a, b)

    (run,) = runs(db, schema)
    assert run["task_id"] == task_id
    assert run["finished_at"] - run["started_at"] >= timedelta(seconds=3 * visibility)
    # from its start to its ack, one delivery under one renewed lease
    assert {(m["attempts"], m["lease"] is not None) for m in seen} <= {(0, False), (1, True)}
    assert len({m["lease"] for m in seen if m["lease"] is not None}) == 1
    assert dead_letters(db, schema) == []
    for worker in (a, b):
        assert "after its lease ended" not in worker.log()
        assert "Traceback" not in worker.log()


def test_poison_task_is_dead_lettered_after_max_attempts(spawn, publisher, db, schema):
    # a long visibility timeout: the retries come from the requeue on worker loss,
    # not from lapsed leases
    w = spawn("a", concurrency=1, max_attempts=3, visibility_timeout=30)
    poison_id = publisher.send_task("lifecycle.poison", ("poison",)).id
    after_id = publisher.send_task("lifecycle.work", ("after",)).id

    wait_for(
        lambda: (
            dead_letters(db, schema)
            and any(r["label"] == "after" and r["finished_at"] for r in runs(db, schema))
        ),
        40,
        "the poison task dead-lettered and the next task done",
        w,
    )

    executions = by_task(runs(db, schema))
    poisoned = executions[poison_id]
    assert len(poisoned) == 3, poisoned
    assert len({r["pid"] for r in poisoned}) == 3  # each attempt killed its pool process
    assert all(r["finished_at"] is None for r in poisoned)
    assert [(r["finished_at"] is not None) for r in executions[after_id]] == [True]
    (dead,) = dead_letters(db, schema)
    assert (dead["task_id"], dead["queue"], dead["reason"], dead["attempts"]) == (
        poison_id,
        "celery",
        "max_attempts",
        3,
    )
    # acks_late: the ack follows the task's end, and the ack thread deletes the row a
    # moment later (batch_acks); nothing may stay behind
    wait_for(lambda: messages(db, schema) == [], 10, "the last ack to be applied", w)
    assert w.proc.poll() is None  # the worker itself carries on


def test_warm_shutdown_releases_prefetched_messages_at_once(spawn, publisher, db, schema):
    ids = [publisher.send_task("lifecycle.block", (f"job{i}", "go")).id for i in range(10)]
    before = {m["task_id"]: m["attempts"] for m in messages(db, schema)}
    assert set(before) == set(ids)
    # a lease this long would keep the messages away for the rest of the test
    w = spawn("a", concurrency=1, prefetch=4, visibility_timeout=60)
    wait_for(
        lambda: runs(db, schema) and sum(m["leased"] for m in messages(db, schema)) == 4,
        30,
        "the worker to run one task and hold 4",
        w,
    )

    held = {m["task_id"] for m in messages(db, schema) if m["leased"]}
    w.terminate()
    # the task is still running when the worker starts its warm shutdown; then it ends
    wait_for(lambda: w.says("Warm shutdown"), 30, "the worker's warm shutdown to start", w)
    open_gate(db, schema, "go", table="ledger_gate")
    assert w.proc.wait(timeout=30) == 0
    rows = messages(db, schema)

    executions = by_task(runs(db, schema))
    # the warm shutdown finished what it had started, and ran nothing twice
    assert all(len(v) == 1 and v[0]["finished_at"] is not None for v in executions.values())
    assert {m["task_id"] for m in rows} == set(ids) - set(executions)
    for m in rows:
        assert m["ready"], m  # no lease: another worker may take it now
        # held by the worker's consumer, so it reached the callback: that delivery
        # counts (a message that takes its worker down must not come back forever)
        assert m["attempts"] == before[m["task_id"]] + (m["task_id"] in held), m
    assert len(held & {m["task_id"] for m in rows}) == 3  # held 4, ran 1
    assert dead_letters(db, schema) == []
    assert "after its lease ended" not in w.log()


def _publish_raw(app: Any, body: Any, task_id: str, **kwargs: Any) -> None:
    """Publish a task message Celery did not make: headers of a real task, any body."""
    with app.producer_or_acquire() as producer:
        producer.publish(
            body,
            routing_key="celery",
            headers={"task": "lifecycle.work", "id": task_id, "lang": "py"},
            retry=False,
            **kwargs,
        )


def test_poison_messages_are_dead_lettered_and_the_worker_goes_on(spawn, publisher, db, schema):
    # bodies that make Celery's consumer raise (a task body is [args, kwargs, embed])
    _publish_raw(publisher, [1, 2], "wrong-shape", serializer="json")
    _publish_raw(publisher, None, "null-body", serializer="json")
    # a body that does not decode: Celery acks it to be rid of it
    _publish_raw(
        publisher,
        b"{not json",
        "undecodable",
        content_type="application/json",
        content_encoding="utf-8",
    )
    after_id = publisher.send_task("lifecycle.work", ("after",)).id
    w = spawn("a", concurrency=2)

    wait_for(
        lambda: (
            len(dead_letters(db, schema)) == 3
            and any(r["label"] == "after" and r["finished_at"] for r in runs(db, schema))
        ),
        40,
        "three dead letters and the task behind them done",
        w,
    )

    assert w.proc.poll() is None  # the worker carries on
    assert [r["task_id"] for r in runs(db, schema)] == [after_id]
    with publisher.connection_for_write() as conn:
        broker = Broker.from_connection(conn)
    shown = {
        d.id: (json.loads(d.headers)["id"], d.reason, d.error)
        for d in broker.dead_letters("celery")
    }
    reasons = {task_id: (reason, error) for task_id, reason, error in shown.values()}
    assert reasons["wrong-shape"][0] == "consumer_error"
    assert reasons["wrong-shape"][1].startswith("ValueError: ")
    assert reasons["null-body"][0] == "consumer_error"
    assert reasons["null-body"][1].startswith("TypeError: ")
    assert reasons["undecodable"][0] == "undecodable"
    assert "DecodeError" in reasons["undecodable"][1]
    for message_id, (_, reason, _) in shown.items():
        if reason == "consumer_error":
            assert f"on message {message_id} of queue 'celery'" in w.log()
    wait_for(lambda: messages(db, schema) == [], 10, "the last ack to be applied", w)
