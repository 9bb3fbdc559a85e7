"""Atomic tasks on real ``celery worker`` processes: the effects of every attempt that
acks its delivery commit with that ack, and those of any other attempt vanish.

Each task writes its effect through ``self.db`` and notes each start of its body on a
connection of its own (``atomic_app``), so the tests count exactly which attempts ran
and which committed.
"""

from __future__ import annotations

import signal

import pytest
from atomic_app import Boom
from celery import chain
from conftest import LATE_ACK, attempts, effects, messages
from helpers import open_gate
from psycopg import sql
from waiting import wait_for

pytestmark = pytest.mark.celery

POOLS = ["prefork", "threads", "solo"]


@pytest.mark.parametrize("pool", POOLS)
def test_outcomes_on_each_pool(pool, spawn, client, db, tables):
    """Commit, rollback on exception, retry (asked for and automatic), replace, a link and
    a chain: each attempt's effects exist exactly when it committed."""
    worker = spawn(pool=pool)
    effect, retrying = client.tasks["atomic.effect"], client.tasks["atomic.retrying"]
    autoretry, replaced = client.tasks["atomic.autoretry"], client.tasks["atomic.replaced"]
    done = [effect.delay(f"ok{i}") for i in range(10)]
    failed = effect.delay("failed", fail=True)
    retried = retrying.delay("retried")
    autoretried = autoretry.delay("autoretried")
    linked = effect.apply_async(("linked",), link=effect.s())
    chained = chain(effect.s("chain-a"), effect.s(), effect.s())()
    replacement = replaced.delay("replaced")
    for result in [*done, retried, autoretried, linked, chained]:
        result.get(timeout=60)
    with pytest.raises(Boom):
        failed.get(timeout=60)
    replacement.get(timeout=60)  # the replacement's result
    wait_for(
        lambda: effects(db, tables)["replaced-replacement"] == 1,
        30,
        "the replacement to commit",
        worker,
    )
    wait_for(lambda: not messages(db, tables), 30, "every message to be acked", worker)

    found = effects(db, tables)
    expected = {f"ok{i}": 1 for i in range(10)}
    # the first attempt of each retried task rolled back: only the retry's effect is left
    expected |= {"retried#1": 1, "autoretried#1": 1}
    # a link and each step of a chain get the previous result, the key, as theirs
    expected |= {"linked": 2, "chain-a": 3}
    expected |= {"replaced": 1, "replaced-replacement": 1}
    assert dict(found) == expected, f"effects {dict(found)}"
    started = attempts(db, tables)
    assert started["failed"] == 1 and started["retried"] == 2 and started["autoretried"] == 2
    assert LATE_ACK not in worker.log()


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_follow_up_exists_only_after_commit(pool, spawn, client, db, tables):
    """A task sent by the body is a row of its transaction: invisible until it commits."""
    worker = spawn(pool=pool)
    effect = client.tasks["atomic.effect"]
    parent = effect.delay("parent", gate="g", follow="child")
    wait_for(lambda: attempts(db, tables)["parent"], 30, "the parent to start", worker)
    # the parent has sent its follow-up and waits: neither its effect nor the follow-up
    # is visible; the queue holds the parent's own message only
    assert not effects(db, tables)
    assert [m["task"] for m in messages(db, tables)] == ["atomic.effect"]
    open_gate(db, tables, "g")
    assert parent.get(timeout=30) == "parent"
    wait_for(lambda: effects(db, tables)["child"] == 1, 30, "the follow-up to run", worker)
    assert effects(db, tables) == {"parent": 1, "child": 1}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_rolled_back_attempt_sends_nothing(pool, spawn, client, db, tables):
    """What a failed attempt published rolled back with it: the follow-up never runs."""
    worker = spawn(pool=pool)
    effect = client.tasks["atomic.effect"]
    with pytest.raises(Boom):
        effect.delay("parent", follow="child", fail=True).get(timeout=30)
    effect.delay("after").get(timeout=30)  # the worker went on, past anything left queued
    wait_for(lambda: not messages(db, tables), 30, "an empty queue", worker)
    assert effects(db, tables) == {"after": 1}
    assert attempts(db, tables) == {"parent": 1, "after": 1}


def test_no_ack_follows_a_commit_from_a_pool_child(spawn, client, db, tables):
    """A prefork child commits the ack with the work; the main process, which consumes,
    learns of it from the success and sends no ack of its own. A failure (rolled back,
    and acked as Celery acks failures) is acked by the main process: that ack deletes
    the row."""
    worker = spawn(pool="prefork", log_acks=1)
    effect = client.tasks["atomic.effect"]
    for key in ("a", "b", "c"):
        assert effect.delay(key).get(timeout=30) == key
    with pytest.raises(Boom):
        effect.delay("failed", fail=True).get(timeout=30)
    wait_for(lambda: "acks of atomic tasks" in worker.log(), 30, "the failure's ack", worker)
    wait_for(lambda: not messages(db, tables), 30, "an empty queue", worker)
    sent = [line for line in worker.log().splitlines() if "acks of atomic tasks" in line]
    assert len(sent) == 1 and "1 of 1 acks" in sent[0], sent
    assert effects(db, tables) == {"a": 1, "b": 1, "c": 1}


def test_lost_lease_rolls_back_when_the_main_process_stalls(spawn, client, db, tables):
    """The main process of the worker running the task stops (SIGSTOP: swapped out, a
    frozen container), so nothing renews the lease; it lapses, and another worker takes
    the message. The first attempt's fenced delete then finds no row: its effects and
    its follow-up vanish, and the other worker's commit is the only one."""
    stalled = spawn(pool="prefork", visibility_timeout=2, polling_interval=0.2)
    effect = client.tasks["atomic.effect"]
    effect.delay("once", gate="g", follow="child")
    wait_for(lambda: attempts(db, tables)["once"], 30, "the first attempt", stalled)
    other = spawn(pool="prefork", visibility_timeout=2, polling_interval=0.2)
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: attempts(db, tables)["once"] >= 2, 60, "a second delivery", other)
        open_gate(db, tables, "g")
        wait_for(lambda: effects(db, tables)["child"] == 1, 30, "the follow-up", other)
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: "was lost" in stalled.log(), 30, "the first attempt to give up", stalled)
    wait_for(lambda: not messages(db, tables), 30, "an empty queue", stalled, other)
    assert effects(db, tables) == {"once": 1, "child": 1}
    assert LATE_ACK not in stalled.log() + other.log()


def test_lost_lease_rolls_back(spawn, client, db, tables):
    """The same in one threads worker, the lease taken away by hand while the attempt
    waits: the row's lease is changed and its time is up, as a claim by another consumer
    after the lease lapsed leaves it. The worker claims the message again (a second
    attempt); the first attempt's fenced delete finds no row and rolls back."""
    worker = spawn(pool="threads", polling_interval=0.2)
    effect = client.tasks["atomic.effect"]
    effect.delay("once", gate="g", follow="child")
    wait_for(lambda: attempts(db, tables)["once"], 30, "the first attempt", worker)
    db.execute(
        sql.SQL(
            "UPDATE {} SET lease = lease + 1, next_iteration = now() - interval '1 second'"
        ).format(sql.Identifier(tables, "message_store"))
    )
    wait_for(lambda: attempts(db, tables)["once"] >= 2, 60, "a second delivery", worker)
    open_gate(db, tables, "g")
    wait_for(lambda: effects(db, tables)["child"] == 1, 30, "the follow-up", worker)
    wait_for(lambda: "was lost" in worker.log(), 30, "the first attempt to give up", worker)
    wait_for(lambda: not messages(db, tables), 30, "an empty queue", worker)
    assert effects(db, tables) == {"once": 1, "child": 1}
    assert LATE_ACK not in worker.log()


def test_long_task_keeps_its_lease(spawn, client, db, tables):
    """A task five times longer than the visibility timeout commits once: the worker's
    lease keeper renews the very lease the task's transaction acks with."""
    worker = spawn(pool="prefork", visibility_timeout=1, polling_interval=0.2)
    # a second worker with idle processes, ready to take a lease that lapses
    other = spawn(pool="prefork", visibility_timeout=1, polling_interval=0.2)
    effect = client.tasks["atomic.effect"]
    result = effect.delay("long", gate="g")
    wait_for(lambda: attempts(db, tables)["long"], 30, "the task to start", worker, other)
    (lease,) = {m["lease"] for m in messages(db, tables)}
    lease_end = sql.SQL(
        "SELECT next_iteration > %s::timestamptz + interval '4 seconds' FROM {} WHERE lease = %s"
    ).format(sql.Identifier(tables, "message_store"))
    started = db.execute("SELECT now()").fetchone()[0]
    # the same lease, renewed until it ends four visibility timeouts after the start
    wait_for(
        lambda: (db.execute(lease_end, (started, lease)).fetchone() or (False,))[0],
        30,
        "the lease to be renewed past four visibility timeouts",
        worker,
        other,
    )
    assert attempts(db, tables) == {"long": 1}
    open_gate(db, tables, "g")
    assert result.get(timeout=30) == "long"
    assert effects(db, tables) == {"long": 1}
    assert attempts(db, tables) == {"long": 1}
    assert LATE_ACK not in worker.log() + other.log()


def test_killed_worker_runs_the_task_again_without_its_effects(spawn, client, db, tables):
    """SIGKILL while the transaction is open: nothing was committed, and the message is
    delivered again when its lease ends; the second run's effect is the only one."""
    worker = spawn(pool="prefork", visibility_timeout=2, polling_interval=0.2)
    effect = client.tasks["atomic.effect"]
    effect.delay("killed", gate="g")
    wait_for(lambda: attempts(db, tables)["killed"], 30, "the task to start", worker)
    worker.kill()
    assert not effects(db, tables)
    open_gate(db, tables, "g")
    again = spawn(pool="prefork", visibility_timeout=2, polling_interval=0.2)
    wait_for(lambda: effects(db, tables)["killed"], 30, "the second run to commit", again)
    wait_for(lambda: not messages(db, tables), 30, "an empty queue", again)
    assert effects(db, tables) == {"killed": 1}
    assert attempts(db, tables) == {"killed": 2}
