"""kombu_pgqueue.transaction(conn): publishes ride on the application's transaction.

Each test watches from outside the transaction: a separate ``Store`` connection
(``store.size``), a second session reading the tables, and a consumer on its own
connection blocked in ``drain_events``. That consumer polls only every 60 s, so a
delivery within seconds of the commit can only come from the commit's NOTIFY.

That a message is NOT delivered is shown by a marker: a message published after it on
the same queue (autocommitted), delivered in publish order. Once the consumer has the
marker, anything that was there to be delivered before it has been.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping
import psycopg
import pytest
from celery.contrib.testing.worker import start_worker
from helpers import row_count
from kombu import Connection, Consumer, Producer, Queue
from psycopg import sql
from sqlalchemy import text
from sqlalchemy.orm import Session
from waiting import wait_for

import kombu_pgqueue
from celery_pgqueue.bulk import send_many

HERE = Path(__file__).resolve().parent
QUEUE = "tx"


class Boom(Exception):
    """Raised inside a transaction block to roll it back."""


class Watcher:
    """A consumer on a connection of its own, blocked in drain_events in a thread."""

    def __init__(self, connection: Connection, queue: str) -> None:
        self.connection = connection
        self.queue = queue
        self.got: list[Any] = []
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_for(self._ready, 15, "the watching consumer to start")
        assert self.error is None, self.error

    def _run(self) -> None:
        try:
            with Consumer(self.connection, [Queue(self.queue)], callbacks=[self._on_message]):
                self._ready.set()
                while not self._stop.is_set():
                    try:
                        self.connection.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def _on_message(self, body: Any, message: Any) -> None:
        self.got.append(body)
        message.ack()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)
        assert not self._thread.is_alive()
        assert self.error is None, self.error


@pytest.fixture
def watch(make_connection: Callable[..., Connection]) -> Iterator[Callable[[str], Watcher]]:
    watchers: list[Watcher] = []

    def watch(queue: str = QUEUE) -> Watcher:
        # the safety poll is a minute away: only a NOTIFY can wake this consumer
        watcher = Watcher(make_connection(polling_interval=60), queue)
        watchers.append(watcher)
        return watcher

    yield watch
    for watcher in watchers:
        watcher.close()


def _insert_order(conn: Any, orders: sql.Composed, order_id: int) -> None:
    conn.execute(sql.SQL("INSERT INTO {} (id) VALUES (%s)").format(orders), (order_id,))


def _marker(connection: Connection, watcher: Watcher, seen_before: list[Any]) -> None:
    """Publish a marker (autocommitted, on the broker's own connection) and wait until
    the watcher has it: then it has everything that was there before the marker, and
    that must be ``seen_before``."""
    Producer(connection).publish({"marker": True}, routing_key=watcher.queue)
    wait_for(lambda: {"marker": True} in watcher.got, 5, "the marker message")
    assert watcher.got == [*seen_before, {"marker": True}]
    # the watcher acks in batches, after its callback: the marker's row goes a moment later
    store = connection.default_channel.store
    with store.pool.connection() as conn:
        wait_for(lambda: row_count(conn, store.schema) == 0, 5, "the watcher's last ack")


# -- psycopg 3 ------------------------------------------------------------------------


def test_psycopg_commit_makes_message_visible_and_wakes_consumer(
    connection, store, app_conn, orders, count_orders, rows, schema, watch
):
    watcher = watch()
    with app_conn.transaction():
        _insert_order(app_conn, orders, 1)
        with kombu_pgqueue.transaction(app_conn):
            Producer(connection).publish({"order": 1}, routing_key=QUEUE)
        # the application's session sees its own message ...
        assert row_count(app_conn, schema) == 1
        # ... nobody else does, and the consumer does not get it
        assert store.size(QUEUE) == 0
        assert rows() == []
        assert count_orders() == 0
        _marker(connection, watcher, [])
    wait_for(lambda: len(watcher.got) == 2, 5, "the consumer to be woken by the commit's NOTIFY")
    assert watcher.got == [{"marker": True}, {"order": 1}]
    assert count_orders() == 1


def test_psycopg_rollback_leaves_no_message(
    connection, store, app_conn, orders, count_orders, rows, watch
):
    watcher = watch()
    with pytest.raises(Boom), app_conn.transaction():
        _insert_order(app_conn, orders, 1)
        with kombu_pgqueue.transaction(app_conn):
            Producer(connection).publish({"order": 1}, routing_key=QUEUE)
        raise Boom
    assert count_orders() == 0
    assert store.size(QUEUE) == 0
    assert rows() == []
    # the consumer was listening all along: a plain publish reaches it, alone
    _marker(connection, watcher, [])


def test_psycopg_savepoint_rollback_drops_only_its_publish(
    connection, app_conn, orders, count_orders, rows, watch
):
    watcher = watch()
    producer = Producer(connection)
    with app_conn.transaction():
        with kombu_pgqueue.transaction(app_conn):
            _insert_order(app_conn, orders, 1)
            producer.publish({"n": "outer"}, routing_key=QUEUE)
            with app_conn.transaction():  # a savepoint
                _insert_order(app_conn, orders, 2)
                producer.publish({"n": "inner"}, routing_key=QUEUE)
                raise psycopg.Rollback()
            producer.publish({"n": "after"}, routing_key=QUEUE)
        assert rows() == []
    wait_for(lambda: len(watcher.got) >= 2, 5, "the committed messages")
    _marker(connection, watcher, [{"n": "outer"}, {"n": "after"}])
    assert count_orders() == 1


def test_publish_outside_the_block_is_autocommitted(
    connection, store, app_conn, orders, rows, watch
):
    watcher = watch()
    producer = Producer(connection)
    from_thread: list[BaseException] = []

    def publish_from_another_thread() -> None:
        try:
            # a thread does not inherit the block: its publish uses the broker's pool
            producer_conn = connection.clone()
            with producer_conn:
                Producer(producer_conn).publish({"n": "thread"}, routing_key=QUEUE)
        except BaseException as exc:
            from_thread.append(exc)

    with pytest.raises(Boom), app_conn.transaction():
        with kombu_pgqueue.transaction(app_conn):
            producer.publish({"n": "enlisted"}, routing_key=QUEUE)
            thread = threading.Thread(target=publish_from_another_thread)
            thread.start()
            thread.join(15)
            assert not from_thread, from_thread
            wait_for(lambda: watcher.got, 5, "the other thread's message")
            assert watcher.got == [{"n": "thread"}]
        # the block is over but the application's transaction is still open
        producer.publish({"n": "outside"}, routing_key=QUEUE)
        wait_for(lambda: len(watcher.got) == 2, 5, "the message published after the block")
        raise Boom
    assert watcher.got == [{"n": "thread"}, {"n": "outside"}]
    _marker(connection, watcher, [{"n": "thread"}, {"n": "outside"}])
    assert store.size(QUEUE) == 0
    assert rows() == []


def test_producer_killed_before_commit_leaves_nothing(
    dsn, broker_base_url, schema, store, db, orders, count_orders, rows
):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "crash_producer.py"), dsn, broker_base_url, schema, QUEUE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("published"):
            proc.kill()
            pytest.fail(f"the producer did not publish: {line!r} {proc.communicate()[1]}")
        _, backend_pid, seen_orders, seen_messages = line.split()
        # inside its transaction it wrote both; outside, nothing is visible yet
        assert (seen_orders, seen_messages) == ("1", "1")
        assert count_orders() == 0
        assert store.size(QUEUE) == 0
    finally:
        proc.kill()
        proc.communicate(timeout=15)

    def backend_gone() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        row = db.execute(query, (int(backend_pid),)).fetchone()
        return row is not None and row[0] == 0

    wait_for(backend_gone, 15, "the killed producer's session to end")
    assert count_orders() == 0
    assert rows() == []
    assert store.size(QUEUE) == 0


def test_schema_in_another_database_raises_configuration_error(
    connection, store, db, rows, schema, other_database_dsn
):
    with psycopg.connect(other_database_dsn) as other:
        assert other.info.dbname != db.info.dbname
        with other.transaction(), kombu_pgqueue.transaction(other):
            with pytest.raises(kombu_pgqueue.ConfigurationError, match=schema):
                Producer(connection).publish({"n": 1}, routing_key=QUEUE)
        row = other.execute("SELECT to_regnamespace(%s) IS NULL", (schema,)).fetchone()
        assert row == (True,)
    # nothing went through the broker's own connections instead
    assert store.size(QUEUE) == 0
    assert rows() == []


def test_schema_in_another_database_fails_celery_delay(app, connection, rows, other_database_dsn):
    @app.task(name="tx.noop", shared=False)
    def noop() -> None:
        pass

    with psycopg.connect(other_database_dsn) as other, other.transaction():
        with kombu_pgqueue.transaction(other), pytest.raises(kombu_pgqueue.ConfigurationError):
            noop.delay()
    assert rows() == []


# -- Celery ---------------------------------------------------------------------------


def test_celery_delay_commit_runs_rollback_never_runs(app, app_conn, orders, count_orders, rows):
    ran: list[str] = []

    @app.task(name="tx.record", shared=False)
    def record(label: str) -> None:
        ran.append(label)

    with start_worker(app, pool="threads", perform_ping_check=False):
        with pytest.raises(Boom), app_conn.transaction():
            _insert_order(app_conn, orders, 1)
            with kombu_pgqueue.transaction(app_conn):
                record.delay("rolled back")
            raise Boom
        with app_conn.transaction():
            _insert_order(app_conn, orders, 2)
            with kombu_pgqueue.transaction(app_conn):
                record.delay("committed")
            assert rows() == []
            # a marker sent outside the block (autocommitted) runs, alone: the worker
            # (one thread, messages in publish order) would have run the other first
            record.delay("marker")
            wait_for(lambda: "marker" in ran, 15, "the marker task to run")
            assert ran == ["marker"]
        wait_for(lambda: "committed" in ran, 15, "the committed task to run")
        record.delay("afterwards")
        wait_for(lambda: "afterwards" in ran, 15, "the task sent afterwards to run")
    assert ran == ["marker", "committed", "afterwards"]
    assert count_orders() == 1


# -- SQLAlchemy -----------------------------------------------------------------------


@contextmanager
def _sa_transaction(engine: Any, kind: str) -> Iterator[Any]:
    """A SQLAlchemy Session or Connection in a transaction (commit, or rollback on error)."""
    if kind == "session":
        with Session(engine) as session, session.begin():
            yield session
    else:
        with engine.connect() as conn, conn.begin():
            yield conn


def _sa_insert_order(handle: Any, orders: sql.Composed, order_id: int) -> None:
    statement = f"INSERT INTO {orders.as_string(None)} (id) VALUES (:id)"  # noqa: S608 - composed
    handle.execute(text(statement), {"id": order_id})


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_sqlalchemy_commit_makes_message_visible(
    kind, engine, connection, store, orders, count_orders, rows, watch
):
    watcher = watch()
    with _sa_transaction(engine, kind) as handle:
        _sa_insert_order(handle, orders, 1)
        with kombu_pgqueue.transaction(handle):
            Producer(connection).publish({"order": 1}, routing_key=QUEUE)
        assert store.size(QUEUE) == 0
        assert rows() == []
        _marker(connection, watcher, [])
    wait_for(lambda: len(watcher.got) == 2, 5, "the consumer to be woken by the commit")
    assert watcher.got == [{"marker": True}, {"order": 1}]
    assert count_orders() == 1


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_sqlalchemy_rollback_leaves_no_message(
    kind, engine, connection, store, orders, count_orders, rows, watch
):
    watcher = watch()
    with pytest.raises(Boom), _sa_transaction(engine, kind) as handle:
        _sa_insert_order(handle, orders, 1)
        with kombu_pgqueue.transaction(handle):
            Producer(connection).publish({"order": 1}, routing_key=QUEUE)
        raise Boom
    assert count_orders() == 0
    assert store.size(QUEUE) == 0
    assert rows() == []
    _marker(connection, watcher, [])


def test_sqlalchemy_savepoint_rollback_drops_only_its_publish(
    engine, connection, orders, count_orders, rows
):
    producer = Producer(connection)
    with Session(engine) as session, session.begin():
        with kombu_pgqueue.transaction(session):
            producer.publish({"n": "outer"}, routing_key=QUEUE)
            nested = session.begin_nested()
            _sa_insert_order(session, orders, 2)
            producer.publish({"n": "inner"}, routing_key=QUEUE)
            nested.rollback()
            _sa_insert_order(session, orders, 1)
    assert count_orders() == 1
    bodies = [bytes(body) for (body,) in rows("body", "queue = %s", QUEUE)]
    assert bodies == [b'{"n": "outer"}']


def test_sqlalchemy_celery_delay_rollback_never_runs(app, engine, rows):
    ran: list[str] = []

    @app.task(name="tx.record", shared=False)
    def record(label: str) -> None:
        ran.append(label)

    with pytest.raises(Boom), Session(engine) as session, session.begin():
        with kombu_pgqueue.transaction(session):
            record.delay("rolled back")
        raise Boom
    with Session(engine) as session, session.begin():
        with kombu_pgqueue.transaction(session):
            record.delay("committed")
    assert [headers["argsrepr"] for (headers,) in rows("headers")] == ["('committed',)"]


# -- bulk -----------------------------------------------------------------------------


def test_send_many_inside_transaction_commits_and_rolls_back_with_it(app, app_conn, rows, store):
    @app.task(name="tx.item", shared=False)
    def item(n: int) -> None:
        pass

    with pytest.raises(Boom), app_conn.transaction():
        with kombu_pgqueue.transaction(app_conn):
            report = send_many(app, [item.s(n) for n in range(5)])
        assert report.enqueued == 5
        assert rows() == []
        raise Boom
    assert rows() == []
    with app_conn.transaction():
        with kombu_pgqueue.transaction(app_conn):
            report = send_many(app, [item.s(n) for n in range(3)] + [item.s(9).set(countdown=60)])
        assert (report.enqueued, report.skipped) == (4, 0)
        assert store.size("celery") == 0
    assert sorted(rows("delayed")) == [(False,), (False,), (False,), (True,)]
