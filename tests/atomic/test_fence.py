"""The broker side of atomic tasks, without Celery: the ack inside the application's
transaction (statement ``ack_in_transaction``), the check that the connection reaches the
broker's database, and the consumer's own ack that comes after (``kombu_pgqueue.atomic``)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import datetime

import plans
import psycopg
import pytest
from helpers import row_count
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import ConfigurationError, atomic
from kombu_pgqueue._settler import Settler
from kombu_pgqueue._sql import queries
from kombu_pgqueue._store import Outgoing, Store, new_lease
from kombu_pgqueue.admin import parse_options
from kombu_pgqueue.atomic import Delivery, Fence, Psycopg, Transaction
from kombu_pgqueue.exceptions import ServerUnavailable

Later = Callable[[float], datetime]


def _claimed(store: Store, queue: str = "q", now: datetime | None = None) -> Delivery:
    store.publish(Outgoing(queue=queue, body=b"x", headers="{}", properties="{}"))
    lease = new_lease()
    [row] = store.claim(queue, 1, lease, now=now)
    return Delivery(message_id=row.id, lease=lease)


@pytest.fixture
def fence(dsn: str, store: Store) -> Fence:
    return Fence(dsn, parse_options({"schema": store.schema}))


@pytest.fixture
def app_conn(dsn: str) -> Iterator[psycopg.Connection]:
    """The application's connection: not autocommit, a transaction per block."""
    with psycopg.connect(dsn) as conn:
        yield conn


def test_ack_in_transaction_commits_with_the_work(store, fence, app_conn, db, schema):
    delivery = _claimed(store)
    assert fence.ack(fence.enlist(app_conn), delivery)
    # deleted, not committed: every other session still sees the message, held by its lease
    assert row_count(db, schema) == 1
    app_conn.commit()
    assert row_count(db, schema) == 0


def test_ack_in_transaction_rolled_back_leaves_the_delivery_as_it_was(
    store, fence, app_conn, db, schema
):
    delivery = _claimed(store)
    assert fence.ack(fence.enlist(app_conn), delivery)
    app_conn.rollback()
    assert row_count(db, schema) == 1
    assert store.ack(delivery.message_id, delivery.lease)  # still this delivery's


def test_ack_in_transaction_finds_no_row_when_the_lease_was_lost(
    store, fence, app_conn, later: Later
):
    first = _claimed(store)
    # the first lease ran out; another consumer has the message now
    [again] = store.claim("q", 1, new_lease(), now=later(61))
    enlisted = fence.enlist(app_conn)
    assert not fence.ack(enlisted, first)
    assert fence.holder(enlisted, first) == "another delivery holds it (attempt 2)"


def _work(conn: psycopg.Connection, schema: str) -> None:
    """The attempt's own write: a table of its own in the broker's schema."""
    conn.execute(sql.SQL("CREATE TABLE {}.work (n int)").format(sql.Identifier(schema)))


def _has_work(db: psycopg.Connection, schema: str) -> bool:
    found = db.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.work",)).fetchone()
    return bool(found and found[0])


@pytest.fixture
def begin(fence: Fence) -> Iterator[Callable[[], Transaction]]:
    """``begin()``: a transaction of one :class:`Psycopg` source, as an attempt opens
    it (a thread's connection, kept between attempts); closed after the test."""
    source = Psycopg()
    opened: list[psycopg.Connection] = []

    def begin() -> Transaction:
        transaction = source.begin(fence)
        opened.append(transaction.handle)
        return transaction

    yield begin
    for conn in opened:
        conn.close()


def _settle(fence: Fence, transaction: Transaction, delivery: Delivery) -> bool:
    return fence.settle(transaction, fence.enlist(transaction.handle, check=False), delivery)


def test_settle_commits_the_work_and_the_ack_in_one(store, fence, begin, db, schema):
    delivery = _claimed(store)
    transaction = begin()
    _work(transaction.handle, schema)
    assert _settle(fence, transaction, delivery)
    assert row_count(db, schema) == 0 and _has_work(db, schema)
    assert transaction.handle.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_settle_of_an_attempt_that_wrote_nothing_opens_its_transaction(
    store, fence, begin, db, schema
):
    """No statement of the work opened the transaction: the ack opens it (no
    "there is no transaction in progress" from the server for the COMMIT)."""
    delivery = _claimed(store)
    transaction = begin()
    notices: list[str] = []
    transaction.handle.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
    assert _settle(fence, transaction, delivery)
    assert row_count(db, schema) == 0
    assert notices == []


def test_settle_of_a_lost_lease_rolls_the_work_back(store, fence, begin, db, schema, later: Later):
    first = _claimed(store)
    [again] = store.claim("q", 1, new_lease(), now=later(61))
    transaction = begin()
    _work(transaction.handle, schema)
    assert not _settle(fence, transaction, first)
    assert not _has_work(db, schema)
    assert row_count(db, schema) == 1  # the other delivery's, untouched
    transaction.handle.execute("SELECT 1")  # the connection goes on
    transaction.close()


def test_settle_refused_otherwise_raises_and_commits_nothing(store, fence, begin, db, schema):
    delivery = _claimed(store)
    transaction = begin()
    transaction.handle.execute("SET TRANSACTION READ ONLY")
    with pytest.raises(ServerUnavailable, match="read-only"):
        _settle(fence, transaction, delivery)
    transaction.close()
    assert row_count(db, schema) == 1
    assert store.ack(delivery.message_id, delivery.lease)  # still this delivery's


def test_settle_whose_commit_fails_raises_and_commits_nothing(store, fence, begin, db, schema):
    """The ack succeeds and the COMMIT fails: a deferred trigger of the work raises
    no_data_found, the SQLSTATE of a lost lease. Not taken for one: an error, and the
    work and the ack are rolled back."""
    delivery = _claimed(store)
    transaction = begin()
    ident = sql.Identifier(schema)
    transaction.handle.execute(
        sql.SQL(
            "CREATE TABLE {}.deferred (n int); "
            "CREATE FUNCTION {}.refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE no_data_found USING MESSAGE = 'refused at commit'; END $$; "
            "CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON {}.deferred "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {}.refuse(); "
            "INSERT INTO {}.deferred VALUES (1)"
        ).format(ident, ident, ident, ident, ident)
    )
    with pytest.raises(psycopg.errors.NoDataFound, match="refused at commit"):
        _settle(fence, transaction, delivery)
    transaction.close()
    assert row_count(db, schema) == 1
    assert store.ack(delivery.message_id, delivery.lease)  # still this delivery's


@pytest.mark.parametrize("how", ["terminated", "timed out idle"])
def test_settle_on_a_connection_that_died_raises_a_connection_error(
    store, fence, begin, db, schema, how
):
    """The server ended the session (a terminate, 57P01; its idle-in-transaction
    timeout, 25P03, which psycopg does not count as a connection error): an
    OperationalError either way, which an atomic task takes as an unknown outcome."""
    delivery = _claimed(store)
    transaction = begin()
    _work(transaction.handle, schema)
    backend = transaction.handle.info.backend_pid
    if how == "terminated":
        db.execute("SELECT pg_terminate_backend(%s)", (backend,))
    else:
        transaction.handle.execute("SET idle_in_transaction_session_timeout = '50ms'")
    gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s"
    wait_for(lambda: db.execute(gone, (backend,)).fetchone() == (True,), 30, "the session to end")
    with pytest.raises(psycopg.OperationalError):
        _settle(fence, transaction, delivery)
    transaction.close()
    assert row_count(db, schema) == 1 and not _has_work(db, schema)
    assert begin().handle.execute("SELECT 1").fetchone() == (1,)  # connects afresh


class _Interrupted(Exception):
    """What the test's SIGUSR1 handler raises (Celery's soft time limit is one such)."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


def test_a_signal_interrupts_a_settle_that_waits(store, fence, begin, db, schema, dsn):
    """A settle that waits for the server (here for a lock on its message row) is
    interrupted by a signal, as any psycopg statement is (a soft time limit, Ctrl-C):
    the statement is cancelled on the server, nothing commits, and the next attempt
    gets a connection that works."""
    delivery = _claimed(store)
    transaction = begin()
    _work(transaction.handle, schema)
    backend = transaction.handle.info.backend_pid
    interrupted = threading.Event()
    message = sql.SQL("SELECT 1 FROM {}.message_store WHERE id = %s FOR UPDATE").format(
        sql.Identifier(schema)
    )
    with psycopg.connect(dsn) as locker:
        locker.execute(message, (delivery.message_id,))

        def interrupt() -> None:
            waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s"
            try:
                with psycopg.connect(dsn, autocommit=True) as watcher:
                    wait_for(
                        lambda: watcher.execute(waiting, (backend,)).fetchone() == (True,),
                        30,
                        "the settle to wait for its row",
                    )
                os.kill(os.getpid(), signal.SIGUSR1)
            finally:
                if not interrupted.wait(30):  # not interrupted: let it finish, and fail
                    locker.rollback()

        previous = signal.signal(signal.SIGUSR1, _interrupt)
        sender = threading.Thread(target=interrupt)
        sender.start()
        try:
            with pytest.raises(_Interrupted):
                _settle(fence, transaction, delivery)
        finally:
            interrupted.set()
            sender.join()
            signal.signal(signal.SIGUSR1, previous)
        transaction.close()  # cancels what still runs on the server, and closes
        gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s"
        wait_for(lambda: db.execute(gone, (backend,)).fetchone() == (True,), 30, "it to end")
        locker.rollback()
    assert row_count(db, schema) == 1 and not _has_work(db, schema)
    assert store.ack(delivery.message_id, delivery.lease)  # still this delivery's
    assert begin().handle.execute("SELECT 1").fetchone() == (1,)


def test_delivery_holder_says_when_the_message_is_gone(store, fence, app_conn):
    delivery = _claimed(store)
    assert store.ack(delivery.message_id, delivery.lease)
    enlisted = fence.enlist(app_conn)
    assert not fence.ack(enlisted, delivery)
    assert fence.holder(enlisted, delivery).startswith("it is gone")


def test_enlist_refuses_a_connection_to_another_database(fence, other_database_dsn, dsn):
    with psycopg.connect(other_database_dsn) as elsewhere:
        with pytest.raises(ConfigurationError, match="cannot span two databases") as raised:
            fence.enlist(elsewhere)
        fence.enlist(elsewhere, check=False)  # a connection opened from fence.conninfo
    # both databases are named
    assert f"database {psycopg.conninfo.conninfo_to_dict(dsn).get('dbname')!r}" in str(raised.value)


def test_delivery_from_properties():
    properties = {"delivery_tag": "12.345", "delivery_info": {"pgqueue_id": 12}}
    assert Delivery.from_properties(properties) == Delivery(message_id=12, lease=345)
    assert Delivery.from_properties(properties).tag == "12.345"  # type: ignore[union-attr]
    # another broker's message, or none
    assert Delivery.from_properties({"delivery_tag": "abc", "delivery_info": {}}) is None
    assert Delivery.from_properties(None) is None
    with pytest.raises(ConfigurationError, match="without ack"):
        Delivery.from_properties({"delivery_tag": "12.0", "delivery_info": {"pgqueue_id": 12}})


def test_ack_in_transaction_and_delivery_holder_use_the_primary_key(store, db, schema):
    store.publish_many(
        [Outgoing(queue="q", body=b"x", headers="{}", properties="{}") for _ in range(5000)]
    )
    db.execute(sql.SQL("ANALYZE {}.message_store").format(sql.Identifier(schema)))
    query = sql.SQL("EXPLAIN (FORMAT JSON) ") + queries(schema)["delivery_holder"]
    with db.transaction(force_rollback=True):
        [[plan]] = db.execute(query, {"id": 42, "now": None}).fetchone()  # type: ignore[misc]
    found = list(plans.nodes(plan["Plan"]))
    assert plans.seq_scans(db, found) == [], plan
    assert "message_store_pkey" in plans.indexes(db, found), plan

    # ack_in_transaction's delete is in function delete_delivery (migration 0013): its
    # plan as the function runs it, which auto_explain reports to this session
    said: list[str] = []
    db.add_notice_handler(lambda diag: said.append(diag.message_primary or ""))
    with db.transaction(force_rollback=True):
        for setting in (
            "LOAD 'auto_explain'",
            "SET LOCAL auto_explain.log_min_duration = 0",
            "SET LOCAL auto_explain.log_nested_statements = on",
            "SET LOCAL auto_explain.log_format = json",
            "SET LOCAL auto_explain.log_level = notice",
        ):
            db.execute(setting)
        db.execute(queries(schema)["ack_in_transaction"], {"id": 42, "lease": 7})
    deletes = [
        json.loads(text.split("\n", 1)[1])["Plan"]
        for text in said
        if "DELETE FROM" in text and "message_store" in text
    ]
    assert len(deletes) == 1, said
    found = list(plans.nodes(deletes[0]))
    assert plans.seq_scans(db, found) == [], deletes[0]
    assert "message_store_pkey" in plans.indexes(db, found), deletes[0]


# -- the consumer's ack after the task's commit ------------------------------------------


@pytest.fixture(params=[True, False], ids=["batched", "direct"])
def held(request: pytest.FixtureRequest, store: Store, dsn: str) -> Iterator[Settler]:
    options = parse_options({"schema": store.schema, "batch_acks": request.param})
    held = Settler(Store(dsn, options), options)
    yield held
    held.close()


def test_ack_after_an_atomic_commit_is_no_late_ack(
    held, store, fence, app_conn, db, schema, caplog
):
    delivery = _claimed(store)
    held.hold(delivery.tag)
    atomic.expect(delivery.tag)  # a worker received it for an atomic task
    assert fence.ack(fence.enlist(app_conn), delivery)
    app_conn.commit()  # in a pool child: the consumer's process does not know
    with caplog.at_level(logging.DEBUG, logger="kombu_pgqueue"):
        held.ack(delivery.tag)
        held.flush_acks()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert row_count(db, schema) == 0


def test_ack_of_a_failed_atomic_task_deletes_the_row(held, store, db, schema):
    """The task rolled back and Celery acks the failure: the row must go."""
    delivery = _claimed(store)
    held.hold(delivery.tag)
    atomic.expect(delivery.tag)
    held.ack(delivery.tag)
    held.flush_acks()
    assert row_count(db, schema) == 0


def test_ack_committed_in_this_process_sends_nothing(held, store, db, schema):
    delivery = _claimed(store)
    held.hold(delivery.tag)
    atomic.expect(delivery.tag)
    atomic.committed(delivery.tag)  # a thread of this process committed it (threads, solo)
    held.ack(delivery.tag)
    held.flush_acks()
    # nothing was sent: had the task not deleted the row, it would still be there
    assert row_count(db, schema) == 1


def test_other_late_acks_are_still_warned_about(held, store, caplog):
    delivery = _claimed(store)
    held.hold(delivery.tag)
    assert store.ack(delivery.message_id, delivery.lease)  # gone, and not by an atomic task
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        held.ack(delivery.tag)
        held.flush_acks()
    assert any("lease ended" in r.getMessage() for r in caplog.records)


def test_a_rejected_atomic_delivery_is_forgotten(held, store):
    delivery = _claimed(store)
    held.hold(delivery.tag)
    atomic.expect(delivery.tag)
    held.reject(delivery.tag, requeue=True)
    assert atomic.take(delivery.tag) is None


def test_a_kombu_consumer_acks_in_its_own_transaction(connection, dsn, db, schema, caplog):
    """docs/atomic.md, "Without Celery": the work and the ack commit together, and the
    consumer's own ack afterwards sends nothing and warns about nothing."""
    from kombu import Queue

    queue = Queue("work", routing_key="work")
    with connection.Producer() as producer:
        producer.publish({"n": 1}, routing_key="work", declare=[queue])
    message = queue(connection.default_channel).get(no_ack=False)
    assert message is not None
    fence = Fence.from_connection(connection)
    delivery = Delivery.from_properties(message.properties)
    assert delivery is not None
    atomic.expect(delivery.tag)
    with psycopg.connect(fence.conninfo) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.effect (n int)").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("INSERT INTO {}.effect VALUES (1)").format(sql.Identifier(schema)))
        assert fence.ack(fence.enlist(conn, check=False), delivery)
    atomic.committed(delivery.tag)
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        message.ack()
    assert not caplog.records
    assert row_count(db, schema) == 0
    effect = db.execute(sql.SQL("SELECT n FROM {}.effect").format(sql.Identifier(schema)))
    assert effect.fetchall() == [(1,)]
