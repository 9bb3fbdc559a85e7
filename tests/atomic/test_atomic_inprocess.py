"""Atomic tasks with an in-process worker (threads pool) and eagerly: where ``self.db``
comes from (psycopg, SQLAlchemy ``Session`` and ``Connection``, Django), what is refused,
and that what Celery sends on success goes out inside the transaction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping for the ping check
import pytest
from celery import chain, signals
from celery.contrib.testing.worker import start_worker
from conftest import attempts, effects, messages
from helpers import configure_django
from psycopg import sql
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker
from waiting import wait_for

import celery_pgqueue
import celery_pgqueue.django
from celery_pgqueue.atomic import AtomicTask, Django, SQLAlchemy
from kombu_pgqueue import ConfigurationError, transactions

pytestmark = pytest.mark.celery


def _sqlalchemy_url(dsn: str) -> str:
    return celery_pgqueue.result_backend_url(dsn).removeprefix("db+")


def _insert(schema: str, style: str = "%(key)s, %(id)s") -> str:
    """The INSERT of an effect; SQLAlchemy's text() takes ":key, :id"."""
    return (
        sql.SQL("INSERT INTO {} (key, task_id) VALUES ({})")
        .format(sql.Identifier(schema, "effect"), sql.SQL(style))
        .as_string(None)
    )


@pytest.fixture
def worker(app, tables) -> Iterator[Any]:
    def start() -> Any:
        return start_worker(app, pool="threads", concurrency=2, perform_ping_check=True)

    yield start


def test_links_and_chains_are_sent_inside_the_transaction(app, tables, worker, db):
    seen: list[tuple[str, bool]] = []

    def note(sender: Any = None, headers: Any = None, **_: Any) -> None:
        seen.append((headers["argsrepr"], transactions.current() is not None))

    @app.task(bind=True, base=AtomicTask, name="ip.step", shared=False)
    def step(self: Any, key: str) -> str:
        self.db.execute(_insert(tables), {"key": key, "id": self.request.id})
        return key + "+"

    signals.before_task_publish.connect(note, weak=False)
    try:
        with worker():
            assert step.apply_async(("a",), link=step.s()).get(timeout=30) == "a+"
            assert chain(step.s("b"), step.s(), step.s())().get(timeout=30) == "b+++"
            wait_for(lambda: sum(effects(db, tables).values()) == 5, 30, "every step to commit")
    finally:
        signals.before_task_publish.disconnect(note)
    # sent by the test: outside any transaction; by a task on success: inside its own
    sent_by_tasks = [entry for entry in seen if entry[0] in ("('a+',)", "('b+',)", "('b++',)")]
    assert sent_by_tasks and all(inside for _, inside in sent_by_tasks), seen
    assert ("('a',)", False) in seen


def test_sqlalchemy_session(app, tables, worker, db, dsn):
    engine = create_engine(_sqlalchemy_url(dsn))
    Session = sessionmaker(engine)

    @app.task(bind=True, base=AtomicTask, atomic_db=SQLAlchemy(Session), name="ip.sa", shared=False)
    def in_session(self: Any, key: str, fail: bool = False) -> str:
        self.db.execute(text(_insert(tables, ":key, :id")), {"key": key, "id": self.request.id})
        if fail:
            raise KeyError(key)
        return type(self.db).__name__

    try:
        with worker():
            assert in_session.delay("kept").get(timeout=30) == "Session"
            with pytest.raises(KeyError):
                in_session.delay("gone", fail=True).get(timeout=30)
            wait_for(lambda: not messages(db, tables), 30, "an empty queue")
        assert effects(db, tables) == {"kept": 1}
    finally:
        engine.dispose()


def test_sqlalchemy_connection(app, tables, worker, db, dsn):
    engine = create_engine(_sqlalchemy_url(dsn))

    @app.task(bind=True, base=AtomicTask, atomic_db=SQLAlchemy(engine), name="ip.sac", shared=False)
    def on_connection(self: Any, key: str) -> str:
        self.db.execute(text(_insert(tables, ":key, :id")), {"key": key, "id": self.request.id})
        return type(self.db).__name__

    try:
        with worker():
            assert on_connection.delay("kept").get(timeout=30) == "Connection"
            wait_for(lambda: not messages(db, tables), 30, "an empty queue")
        assert effects(db, tables) == {"kept": 1}
    finally:
        engine.dispose()


def test_another_database_is_refused_at_first_use(app, tables, worker, db, other_database_dsn):
    engine = create_engine(_sqlalchemy_url(other_database_dsn))

    @app.task(
        bind=True, base=AtomicTask, atomic_db=SQLAlchemy(engine), name="ip.away", shared=False
    )
    def elsewhere(self: Any) -> None:
        raise AssertionError("the body must not run")

    try:
        with worker():
            with pytest.raises(ConfigurationError, match="cannot span two databases") as raised:
                elsewhere.delay().get(timeout=30)
            # it names what gave the connection, not transaction(), which the user never called
            assert str(raised.value).startswith(
                "task ip.away's atomic_db (SQLAlchemy) gave a connection to "
            )
            assert "Point it at the broker's database" in str(raised.value)
    finally:
        engine.dispose()


def test_django_connection(app, tables, worker, db, dsn, other_database_dsn):
    configure_django(dsn, other_database_dsn)
    from django.db import transaction

    @app.task(bind=True, base=AtomicTask, atomic_db=Django(), name="ip.dj", shared=False)
    def in_django(self: Any, key: str, fail: bool = False) -> bool:
        committed: list[str] = []
        transaction.on_commit(lambda: committed.append(key))
        with self.db.cursor() as cur:
            cur.execute(_insert(tables), {"key": key, "id": self.request.id})
        try:
            with transaction.atomic():  # a savepoint of the task's transaction
                with self.db.cursor() as cur:
                    cur.execute(_insert(tables), {"key": key + "-inner", "id": ""})
                raise KeyError("roll back the savepoint only")
        except KeyError:
            pass
        if fail:
            raise ValueError(key)
        return self.db.in_atomic_block and not committed

    with worker():
        assert in_django.delay("kept").get(timeout=30) is True
        with pytest.raises(ValueError):
            in_django.delay("gone", fail=True).get(timeout=30)
        wait_for(lambda: not messages(db, tables), 30, "an empty queue")
    assert effects(db, tables) == {"kept": 1}


def test_eager_calls_run_in_a_transaction_without_a_delivery(app, tables, db):
    app.conf.task_always_eager = True

    @app.task(bind=True, base=AtomicTask, name="ip.eager", shared=False)
    def eager(self: Any, key: str, fail: bool = False) -> str:
        self.db.execute(_insert(tables), {"key": key, "id": ""})
        if fail:
            raise KeyError(key)
        return key

    assert eager.delay("kept").get() == "kept"
    with pytest.raises(KeyError):
        eager.apply(("gone",), {"fail": True}).get()
    assert effects(db, tables) == {"kept": 1}
    # called as a function, it is the function: no transaction of its own
    with pytest.raises(RuntimeError, match="self.db exists while"):
        eager("called")


def test_acks_late_off_is_refused(app, tables, worker, db):
    @app.task(bind=True, base=AtomicTask, acks_late=False, name="ip.early", shared=False)
    def early(self: Any) -> None:
        raise AssertionError("the body must not run")

    with worker():
        with pytest.raises(ConfigurationError, match="acks_late"):
            early.delay().get(timeout=30)
    assert not attempts(db, tables)
