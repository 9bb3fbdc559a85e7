"""Tasks that fail for good stay in the broker (``pgqueue_keep_failed``), on real workers.

A prefork ``celery worker`` process runs tasks that fail until a gate opens, with early
acks, late acks (the message acked, or rejected, after the failure), retries, a pool
process that dies and a hard time limit (Celery's main process fails those two). Each
one's message becomes a dead letter with reason ``failed``, the same whichever way it
was settled, and ``celery pgqueue dead requeue`` runs it again with its task id, which
updates its result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_apps import CONF, TRANSPORT_OPTIONS
from helpers import open_gate
from psycopg import sql
from psycopg.rows import dict_row
from waiting import wait_for

import celery_pgqueue
from kombu_pgqueue.admin import Broker, DeadLetter

pytestmark = pytest.mark.celery

#: the message properties that only a publish has (Kombu's own delivery tag) or that a
#: claim consumes (a TTL's expiration): a message rebuilt from its task's request has
#: neither
PUBLISH_ONLY = ("delivery_tag", "expiration")

#: the Celery headers of a task message that name it, for comparing letters of two tasks
NAMING = ("id", "task", "root_id", "origin")


def table(
    db: psycopg.Connection, schema: str, name: str, order: str = "id"
) -> list[dict[str, Any]]:
    with db.cursor(row_factory=dict_row) as cur:
        query = sql.SQL("SELECT * FROM {} ORDER BY {}").format(
            sql.Identifier(schema, name), sql.Identifier(order)
        )
        return cur.execute(query).fetchall()


def stored(db: psycopg.Connection, schema: str) -> dict[str, dict[str, Any]]:
    """The message rows by task id, headers and properties as their stored JSON text."""
    with db.cursor(row_factory=dict_row) as cur:
        query = sql.SQL(
            "SELECT id, queue, priority, body, content_type, content_encoding, "
            "headers::text AS headers, properties::text AS properties FROM {} ORDER BY id"
        ).format(sql.Identifier(schema, "message_store"))
        return {json.loads(row["headers"])["id"]: row for row in cur.execute(query)}


def content(row: dict[str, Any] | DeadLetter, *, naming: bool = True) -> dict[str, Any]:
    """A message's content as parsed values (a message row or a letter); without the
    headers and properties that name its task and call unless ``naming``."""
    fields = row if isinstance(row, dict) else asdict(row)
    headers = json.loads(fields["headers"])
    properties = json.loads(fields["properties"])
    if not naming:
        headers = {k: v for k, v in headers.items() if k not in NAMING}
        properties = {k: v for k, v in properties.items() if k != "correlation_id"}
    return {
        "queue": fields["queue"],
        "priority": fields["priority"],
        "body": json.loads(bytes(fields["body"])),
        "content_type": fields["content_type"],
        "content_encoding": fields["content_encoding"],
        "headers": headers,
        "properties": {k: v for k, v in properties.items() if k not in PUBLISH_ONLY},
    }


@pytest.fixture
def broker(dsn: str, schema: str, client: Celery) -> Broker:
    return Broker(dsn, schema=schema)


def failed(broker: Broker, count: int) -> list[DeadLetter]:
    """Wait for ``count`` letters with reason failed; return them."""

    def found() -> list[DeadLetter] | None:
        letters = broker.dead_letters(reason="failed", limit=None)
        return letters if len(letters) >= count else None

    return wait_for(
        found,
        60,
        f"{count} failed tasks in the dead letters",
        details=lambda: broker.dead_letters(limit=None),
    )


def test_failed_tasks_are_kept_whatever_settles_them_and_run_again_with_their_ids(
    client, broker, spawn, cli, db, schema
):
    call: dict[str, Any] = {"priority": 3, "headers": {"tenant": "acme"}}
    early = client.tasks["archive.charge"].apply_async(("card", 10), {"currency": "USD"}, **call)
    late = client.tasks["archive.charge_late"].apply_async(
        ("card", 10), {"currency": "USD"}, **call
    )
    rejected = client.tasks["archive.charge_rejected"].apply_async(
        ("card", 10), {"currency": "USD"}, **call
    )
    retried = client.tasks["archive.retried"].delay("retried")
    crashed = client.tasks["archive.crash"].delay("crashed")
    slow = client.tasks["archive.slow"].delay("slow")
    everything = (early, late, rejected, retried, crashed, slow)
    sent = stored(db, schema)
    assert len(sent) == 6

    worker = spawn("w1", ready=True)
    letters = {json.loads(d.headers)["id"]: d for d in failed(broker, 6)}

    assert sorted(letters) == sorted(r.id for r in everything)
    assert {d.reason for d in letters.values()} == {"failed"}
    # each message is settled once (the acks that follow a failure come in batches)
    wait_for(lambda: table(db, schema, "message_store") == [], 30, "every message settled")
    for result in (early, late, rejected, crashed, slow):
        letter = letters[result.id]
        assert (letter.id, letter.attempts) == (sent[result.id]["id"], 1)
        # early acks: rebuilt from the task's request, as the message was sent
        assert content(letter) == content(sent[result.id])
    for result in (late, rejected):
        # late acks, acked or rejected after the failure: the stored row itself
        letter, row = letters[result.id], sent[result.id]
        assert (letter.headers, letter.properties, bytes(letter.body)) == (
            row["headers"],
            row["properties"],
            bytes(row["body"]),
        )
    # whichever way a call is settled, its letter is the same
    same = [content(letters[r.id], naming=False) for r in (early, late, rejected)]
    assert same[0] == same[1] == same[2]

    early_letter = letters[early.id]
    assert early_letter.error == "archive_app.Declined: card declined: card"
    assert early_letter.traceback is not None
    assert "raise Declined" in early_letter.traceback
    assert early_letter.traceback.rstrip().endswith("Declined: card declined: card")
    assert json.loads(bytes(early_letter.body))[:2] == [["card", 10], {"currency": "USD"}]
    assert json.loads(early_letter.headers)["retries"] == 0

    # retried twice, then failed for good: one letter, of the last retry's message
    retry_letter = letters[retried.id]
    assert json.loads(retry_letter.headers)["retries"] == 2
    assert retry_letter.error == "archive_app.Declined: card declined: retried"
    runs = table(db, schema, "runs", order="run")
    assert [r["retries"] for r in runs if r["task_id"] == retried.id] == [0, 1, 2]

    # the pool process died: Celery's main process failed the task
    assert letters[crashed.id].error.startswith(
        "billiard.exceptions.WorkerLostError: Worker exited prematurely"
    )
    # the main process killed it at its hard time limit
    assert letters[slow.id].error == "billiard.exceptions.TimeLimitExceeded: TimeLimitExceeded(3,)"
    assert [d.reason for d in broker.dead_letters(limit=None)] == ["failed"] * 6

    for result in everything:
        assert client.AsyncResult(result.id).state == "FAILURE"
    log = worker.log()
    assert "acks came after their lease ended" not in log
    assert "could not be kept" not in log

    listed = json.loads(cli("dead", "list", "--reason", "failed", "--json").stdout)
    assert {(d["task_id"], d["task"], d["retries"]) for d in listed} == {
        (early.id, "archive.charge", 0),
        (late.id, "archive.charge_late", 0),
        (rejected.id, "archive.charge_rejected", 0),
        (retried.id, "archive.retried", 2),
        (crashed.id, "archive.crash", 0),
        (slow.id, "archive.slow", 0),
    }
    assert {d["argsrepr"] for d in listed if d["task_id"] == early.id} == {"('card', 10)"}
    assert json.loads(cli("dead", "list", "--reason", "rejected", "--json").stdout) == []
    shown = json.loads(cli("dead", "show", str(early_letter.id), "--json").stdout)
    assert shown["traceback"] == early_letter.traceback
    assert shown["error"] == early_letter.error

    for label in ("card", "retried", "crashed", "slow"):
        open_gate(db, schema, label)
    done = cli("dead", "requeue", "--all", "--reason", "failed")
    assert done.stdout.strip() == "requeued 6 dead letters into celery"

    def results() -> dict[str, Any]:
        found = {r.id: client.AsyncResult(r.id) for r in everything}
        return {i: r.result for i, r in found.items() if r.state == "SUCCESS"}

    values = wait_for(lambda: len(results()) == 6 and results(), 60, "the requeued tasks", worker)
    assert values == {
        early.id: "paid card 10 USD",
        late.id: "paid card 10 USD",
        rejected.id: "paid card 10 USD",
        retried.id: "paid retried",
        crashed.id: "paid crashed",
        slow.id: "paid slow",
    }
    assert broker.dead_letters(limit=None) == []
    again = [r for r in table(db, schema, "runs", order="run") if r["run"] > runs[-1]["run"]]
    assert sorted(r["task_id"] for r in again) == sorted(values)
    # a requeued task runs with its retries so far: one more failure would be final
    assert {r["retries"] for r in again if r["task_id"] == retried.id} == {2}


def test_failed_tasks_are_not_kept_without_the_setting(client, broker, spawn, db, schema):
    failing = client.tasks["archive.charge"].delay("nope", 1)
    failing_late = client.tasks["archive.charge_late"].delay("nope", 1)
    open_gate(db, schema, "after")
    after = client.tasks["archive.charge"].delay("after", 1)

    # one pool process: the last task starts once the others' failures are handled
    spawn("off", concurrency=1, ready=True, keep_failed=0)

    wait_for(lambda: client.AsyncResult(after.id).state == "SUCCESS", 60, "the last task")
    wait_for(lambda: table(db, schema, "message_store") == [], 30, "every message settled")
    assert client.AsyncResult(failing.id).state == "FAILURE"
    assert client.AsyncResult(failing_late.id).state == "FAILURE"
    assert broker.dead_letters(limit=None) == []


@pytest.fixture
def threads_app(dsn: str, schema: str, client: Celery) -> Iterator[Celery]:
    """An app configured with ``keep_failed=True`` (not the setting), in this process."""
    app = Celery("archive_threads", set_as_current=False)
    celery_pgqueue.configure(app, dsn, keep_failed=True, schema=schema, **TRANSPORT_OPTIONS)
    app.conf.update(CONF)

    @app.task(name="threads.fail", shared=False)
    def fail(label: str) -> None:
        raise KeyError(label)

    yield app
    app.close()


def test_configure_keep_failed_keeps_tasks_of_an_in_process_threads_worker(
    threads_app, broker, db, schema
):
    assert threads_app.conf.pgqueue_keep_failed is True
    fail = threads_app.tasks["threads.fail"]
    plain = fail.delay("missing")
    packed = fail.apply_async(("packed",), compression="zlib")
    sent = stored(db, schema)

    with start_worker(threads_app, pool="threads", concurrency=2, perform_ping_check=False):
        letters = {json.loads(d.headers)["id"]: d for d in failed(broker, 2)}

    letter = letters[plain.id]
    assert letter.error == "KeyError: 'missing'"
    assert letter.traceback is not None and "raise KeyError(label)" in letter.traceback
    assert threads_app.AsyncResult(plain.id).state == "FAILURE"
    # early acks: rebuilt from the request, compressed as it was sent
    for result in (plain, packed):
        assert bytes(letters[result.id].body) == bytes(sent[result.id]["body"])
        assert letters[result.id].headers == sent[result.id]["headers"]
    assert json.loads(letters[packed.id].headers)["compression"] == "application/x-gzip"


def test_eager_calls_are_not_kept(threads_app, broker):
    threads_app.conf.task_always_eager = True
    result = threads_app.tasks["threads.fail"].delay("eager")

    assert result.state == "FAILURE"
    assert broker.dead_letters(limit=None) == []


def test_a_failed_task_handed_off_to_an_idle_worker_is_kept_as_it_was_sent(
    client, broker, spawn, db, schema
):
    """A claim and a handoff add their own keys to the delivery (pgqueue_id, attempts,
    pgqueue_handoff ...); the letter keeps what the publisher sent, whichever brought it."""
    claimed = client.tasks["archive.charge"].delay("claimed", 1)
    sent = stored(db, schema)[claimed.id]
    spawn("idle", concurrency=1, ready=True)
    failed(broker, 1)
    waiters = sql.SQL("SELECT count(*) FROM {} WHERE queue = 'celery'").format(
        sql.Identifier(schema, "listener")
    )
    # the worker waits for its queue: the next publish is leased to it in its NOTIFY
    wait_for(lambda: db.execute(waiters).fetchone() == (1,), 30, "the idle worker's waiter row")

    handed = client.tasks["archive.charge"].delay("handed", 1)

    letters = {json.loads(d.headers)["id"]: d for d in failed(broker, 2)}
    came = {r["task_id"]: r["handoff"] for r in table(db, schema, "runs", order="run")}
    assert came == {claimed.id: False, handed.id: True}  # one of each way
    expected = content(sent, naming=False)["properties"]
    for result in (claimed, handed):
        assert content(letters[result.id], naming=False)["properties"] == expected
