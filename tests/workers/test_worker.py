"""Celery features that depend on the broker, each shown with a real worker."""

from __future__ import annotations

import threading

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping for the ping check
import pytest
from celery import chain, chord, group
from celery.contrib.testing.worker import start_worker
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue.admin import Broker

pytestmark = pytest.mark.celery


def _tasks(app):
    @app.task(name="t.add", shared=False)
    def add(x, y):
        return x + y

    @app.task(name="t.total", shared=False)
    def total(xs):
        return sum(xs)

    @app.task(name="t.record", bind=True, shared=False)
    def record(self, label, sink=[]):  # noqa: B006 - a shared list is the point
        sink.append((label, self.request.delivery_info.get("priority")))
        return label

    @app.task(
        name="t.flaky",
        bind=True,
        shared=False,
        autoretry_for=(KeyError,),
        retry_backoff=0.05,
        retry_jitter=False,
        max_retries=3,
    )
    def flaky(self):
        if self.request.retries < 2:
            raise KeyError("again")
        return self.request.retries

    return add, total, record, flaky


def test_delay_chain_group_chord(app):
    add, total, _, _ = _tasks(app)
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=True):
        assert add.delay(2, 3).get(timeout=20) == 5
        assert chain(add.s(1, 1), add.s(10))().get(timeout=20) == 12
        assert group(add.s(i, i) for i in range(10))().get(timeout=20) == [2 * i for i in range(10)]
        assert chord((add.s(i, 1) for i in range(5)), total.s())().get(timeout=30) == 15


def test_countdown_waits_in_postgres_not_in_the_worker(app, schema, db):
    add, *_ = _tasks(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True) as w:
        result = add.apply_async((20, 22), countdown=3)
        row = db.execute(
            sql.SQL("SELECT delayed FROM {}.message_store WHERE queue = 'celery'").format(
                sql.Identifier(schema)
            )
        ).fetchall()
        assert row == [(True,)]
        # the worker holds nothing in memory for it: ETA tasks wait in the table
        scheduled = app.control.inspect(timeout=5).scheduled()
        assert scheduled == {w.hostname: []}
        assert result.get(timeout=20) == 42


def test_priority_higher_first(app):
    _, _, record, _ = _tasks(app)
    app.conf.worker_prefetch_multiplier = 1
    for label, priority in [("low", 1), ("high", 9), ("mid", 5), ("high2", 9)]:
        record.apply_async((label,), priority=priority)
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False):
        last = record.apply_async(("last",), priority=0)
        last.get(timeout=20)
    sink = record.run.__defaults__[0]
    order = [label for label, _ in sink]
    assert order == ["high", "high2", "mid", "low", "last"]


def test_autoretry_with_backoff(app):
    *_, flaky = _tasks(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        assert flaky.delay().get(timeout=30) == 2


def test_inspect_and_control(app):
    add, *_ = _tasks(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True) as w:
        inspect = app.control.inspect(timeout=5)
        assert w.hostname in (inspect.ping() or {})
        queues = inspect.active_queues()
        assert [q["name"] for q in queues[w.hostname]] == ["celery"]
        assert inspect.stats()[w.hostname]["broker"]["transport"] == "pgqueue"
        reply = app.control.rate_limit("t.add", "100/m", reply=True, timeout=5)
        assert reply and "ok" in reply[0][w.hostname]
        reply = app.control.add_consumer("extra", reply=True, timeout=5)
        assert reply and "ok" in reply[0][w.hostname]
        assert add.apply_async((1, 2), queue="extra").get(timeout=20) == 3
        reply = app.control.cancel_consumer("extra", reply=True, timeout=5)
        assert reply and "ok" in reply[0][w.hostname]


def test_revoke_before_delivery(app):
    add, *_ = _tasks(app)
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True):
        doomed = add.apply_async((1, 1), countdown=2)
        doomed.revoke()
        kept = add.apply_async((2, 2), countdown=2)
        assert kept.get(timeout=20) == 4
        with pytest.raises(Exception) as excinfo:
            doomed.get(timeout=10)
        assert "revoked" in repr(excinfo.value).lower() or doomed.state == "REVOKED"


def test_events_reach_a_receiver(app):
    add, *_ = _tasks(app)
    app.conf.worker_send_task_events = True
    app.conf.task_send_sent_event = True
    seen: list[str] = []
    done = threading.Event()
    consuming = threading.Event()

    def on_event(event):
        seen.append(event["type"])
        if event["type"] == "task-succeeded" and "task-received" in seen:
            done.set()

    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=True):
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": on_event})
            on_consume_ready = receiver.on_consume_ready

            def ready(*args, **kwargs):
                on_consume_ready(*args, **kwargs)  # its queue is bound by now
                consuming.set()

            receiver.on_consume_ready = ready
            thread = threading.Thread(
                target=lambda: receiver.capture(limit=None, timeout=None, wakeup=True),
                daemon=True,
            )
            receiver.should_stop = False
            thread.start()
            wait_for(consuming, 20, "the event receiver to consume")
            add.delay(1, 2).get(timeout=20)
            wait_for(done, 20, "the task's task-received and task-succeeded events")
            receiver.should_stop = True
            thread.join(timeout=10)
    assert "task-succeeded" in seen
    assert "task-received" in seen


def test_purge(app):
    add, *_ = _tasks(app)
    for i in range(5):
        add.delay(i, i)
    assert app.control.purge() == 5
    assert app.control.purge() == 0


def test_configure_sets_broker_and_backend(app, schema):
    assert app.conf.broker_url.startswith("pgqueue")
    assert app.conf.broker_transport_options["schema"] == schema
    assert app.conf.result_backend.startswith("db+postgresql+psycopg://")


def test_an_unregistered_tasks_dead_letter_says_what_happened(app, worker):
    """Celery rejects a task it does not know, inside its ``except KeyError``; the
    dead letter keeps that error (it was empty: reason 'rejected' and nothing else)."""
    app.send_task("proj.missing", args=(1,))
    with app.connection_for_write() as conn:
        broker = Broker.from_connection(conn)
    [dead] = wait_for(lambda: broker.dead_letters("celery"), 20, "the task's dead letter")
    assert dead.reason == "rejected"
    assert dead.error is not None and "proj.missing" in dead.error, dead.error
