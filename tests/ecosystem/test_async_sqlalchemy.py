"""SQLAlchemy's AsyncSession and AsyncConnection (postgresql+psycopg): enqueue in their transaction.

``celery_pgqueue.asyncio.enqueue`` publishes through ``run_sync``. Each test runs
its coroutine with ``asyncio.run`` and makes its async engine inside it (an
engine's connections belong to one event loop). A real in-process worker runs the
tasks; each task checks, from a connection of its own, that its order is committed.

Run as a script, this module is the producer of the crash test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery_apps import celery_app
from psycopg import sql
from shipping import shipping
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from waiting import wait_for

import celery_pgqueue
import kombu_pgqueue
from celery_pgqueue.asyncio import enqueue, run_enlisted
from celery_pgqueue.bulk import send_many

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve()


class Boom(Exception):
    """Raised inside a transaction to roll it back."""


def _async_url(dsn: str) -> str:
    return celery_pgqueue.result_backend_url(dsn).removeprefix("db+")


@asynccontextmanager
async def _engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(_async_url(dsn))
    try:
        yield engine
    finally:
        await engine.dispose()


@asynccontextmanager
async def _handle(engine: AsyncEngine, kind: str) -> AsyncIterator[Any]:
    """An AsyncSession or AsyncConnection in a transaction (commit, or rollback on error)."""
    if kind == "session":
        async with AsyncSession(engine) as session, session.begin():
            yield session
    else:
        async with engine.connect() as conn, conn.begin():
            yield conn


async def _insert_order(handle: Any, schema: str, order_id: int) -> None:
    table = sql.Identifier(schema, "orders").as_string(None)
    await handle.execute(text(f"INSERT INTO {table} (id) VALUES (:id)"), {"id": order_id})  # noqa: S608


@pytest.fixture
def app(app: Celery, schema: str, db: psycopg.Connection) -> Celery:
    """The ecosystem tests' app (``conftest.py``), with the ``orders`` table beside it."""
    db.execute(
        sql.SQL("CREATE TABLE {} (id int PRIMARY KEY)").format(sql.Identifier(schema, "orders"))
    )
    return app


@pytest.fixture
def ship(app: Celery, dsn: str, schema: str) -> Iterator[Any]:
    with shipping(app, dsn, sql.Identifier(schema, "orders")) as ship:
        yield ship


@pytest.fixture
def count_orders(db: psycopg.Connection, schema: str) -> Callable[[], int]:
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "orders"))

    def count() -> int:
        row = db.execute(query).fetchone()
        assert row is not None
        return int(row[0])

    return count


# -- commit, rollback, savepoints -------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_commit_runs_the_task_after_the_order_is_committed(kind, dsn, schema, ship, messages):
    async def place() -> list[Any]:
        async with _engine(dsn) as engine, _handle(engine, kind) as handle:
            await _insert_order(handle, schema, 1)
            results = await enqueue(handle, ship.s(1))
            assert messages() == []
            # the transaction's own session sees the row
            table = sql.Identifier(schema, "message_store").as_string(None)
            own = await handle.execute(text(f"SELECT count(*) FROM {table}"))  # noqa: S608
            assert own.scalar() == 1
        return results

    [result] = asyncio.run(place())
    assert ship.shipped.ran(1) == {1: True}
    assert result.id


@pytest.mark.parametrize("kind", ["session", "connection"])
def test_rollback_leaves_no_message_and_no_run(kind, dsn, schema, ship, messages, count_orders):
    async def place(order_id: int, fail: bool) -> None:
        async with _engine(dsn) as engine, _handle(engine, kind) as handle:
            await _insert_order(handle, schema, order_id)
            await enqueue(handle, ship.s(order_id))
            if fail:
                raise Boom

    with pytest.raises(Boom):
        asyncio.run(place(1, fail=True))
    assert messages() == []
    assert count_orders() == 0
    asyncio.run(place(2, fail=False))
    assert ship.shipped.ran(2) == {2: True}
    assert list(ship.shipped.seen) == [2]


def test_nested_rollback_drops_only_its_task(dsn, schema, ship, messages, count_orders):
    async def place() -> None:
        async with _engine(dsn) as engine, _handle(engine, "session") as session:
            await _insert_order(session, schema, 1)
            await enqueue(session, ship.s(1))
            with pytest.raises(Boom):
                async with session.begin_nested():
                    await _insert_order(session, schema, 2)
                    await enqueue(session, ship.s(2))
                    raise Boom
            await _insert_order(session, schema, 3)
            await enqueue(session, ship.s(3))

    asyncio.run(place())
    assert ship.shipped.ran(1, 3) == {1: True, 3: True}
    assert 2 not in ship.shipped.seen
    assert count_orders() == 2


def test_run_enlisted_takes_any_publishing_function(dsn, app, messages):
    @app.task(name="eco.item", shared=False)
    def item(n: int) -> None:
        pass

    async def send(fail: bool) -> int:
        async with _engine(dsn) as engine, _handle(engine, "session") as session:
            report = await run_enlisted(session, send_many, app, [item.s(n) for n in range(3)])
            assert messages() == []
            if fail:
                raise Boom
        return int(report.enqueued)

    with pytest.raises(Boom):
        asyncio.run(send(fail=True))
    assert messages() == []
    assert asyncio.run(send(fail=False)) == 3
    assert messages() == ["(0,)", "(1,)", "(2,)"]


def test_the_loop_runs_while_the_insert_waits(dsn, schema, app, messages):
    """The INSERT is awaited on the async driver: other coroutines run meanwhile."""

    @app.task(name="eco.noop", shared=False)
    def noop() -> None:
        pass

    async def scenario() -> None:
        async with _engine(dsn) as engine:
            async with _handle(engine, "session") as session:
                await enqueue(session, noop.s())  # Celery declares the queue once, here
            observer = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            locker = await psycopg.AsyncConnection.connect(dsn)
            try:
                # SHARE blocks INSERTs into the message table, not reads
                table = sql.Identifier(schema, "message_store")
                await locker.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(table))
                async with _handle(engine, "session") as session:
                    pid = (await session.execute(text("SELECT pg_backend_pid()"))).scalar()
                    pending = asyncio.create_task(enqueue(session, noop.s()))
                    # this loop runs only if enqueue() yields while its INSERT waits
                    while True:
                        cur = await observer.execute(
                            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
                        )
                        if await cur.fetchone() == ("Lock",):
                            break
                        assert not pending.done(), pending.result()
                    await locker.rollback()
                    await asyncio.wait_for(pending, 15)
            finally:
                await observer.close()
                await locker.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert messages() == ["()", "()"]


# -- crash, other databases, refusals ---------------------------------------------------


def test_producer_dying_before_commit_leaves_neither(dsn, schema, app, db, messages, count_orders):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(HERE), dsn, schema],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 3, (done.stdout, done.stderr)
    said, backend_pid, seen_orders, seen_messages = done.stdout.split()
    assert said == "published"
    assert (seen_orders, seen_messages) == ("1", "1")

    def backend_gone() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        return db.execute(query, (int(backend_pid),)).fetchone() == (0,)

    wait_for(backend_gone, 15, "the dead producer's session to end")
    assert count_orders() == 0
    assert messages() == []


def test_another_database_raises_configuration_error(
    dsn, other_database_dsn, schema, app, messages
):
    async def place() -> None:
        async with _engine(other_database_dsn) as engine, _handle(engine, "session") as session:
            with pytest.raises(kombu_pgqueue.ConfigurationError, match=schema):
                await enqueue(session, app.signature("eco.ship", args=[1]))

    asyncio.run(place())
    assert messages() == []


def test_async_handles_are_refused_by_transaction(dsn, app, messages):
    async def misuse() -> None:
        async with _engine(dsn) as engine, _handle(engine, "session") as session:
            with pytest.raises(kombu_pgqueue.ConfigurationError, match="run_sync"):
                with kombu_pgqueue.transaction(session):
                    app.send_task("eco.ship", args=[1])
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            with pytest.raises(kombu_pgqueue.ConfigurationError, match="asynchronous"):
                with kombu_pgqueue.transaction(conn):
                    pass

    asyncio.run(misuse())
    with Session() as session, pytest.raises(TypeError, match="AsyncSession"):
        asyncio.run(run_enlisted(session, print))
    assert messages() == []


async def _crash_producer(dsn: str, schema: str) -> None:
    """Insert an order and enqueue its task in one transaction, then die before commit."""
    app = celery_app(dsn, schema, main="crash", results=False)
    async with _engine(dsn) as engine, _handle(engine, "session") as session:
        await _insert_order(session, schema, 7)
        await enqueue(session, app.signature("eco.ship", args=[7]))
        orders = sql.Identifier(schema, "orders").as_string(None)
        message = sql.Identifier(schema, "message_store").as_string(None)
        query = f"SELECT pg_backend_pid(), (SELECT count(*) FROM {orders}), count(*) FROM {message}"  # noqa: S608, E501
        row = await session.execute(text(query))
        print("published", *row.one(), flush=True)
        os._exit(3)


if __name__ == "__main__":
    asyncio.run(_crash_producer(*sys.argv[1:3]))
