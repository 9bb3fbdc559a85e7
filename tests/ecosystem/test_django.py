"""Django: tasks enqueued inside ``transaction.atomic()`` through Django's connection.

Django is configured once for the module, on the test database ("default") and on
another database of the same server ("elsewhere", where the broker schema is not).
``Order`` is a model on a table of its own, unique to this run. Each test has its
own broker schema and Celery app; a real in-process worker runs the tasks, and
each task checks, from a connection of its own, that its order is committed.

Run as a script, this module is the producer of the crash test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery_apps import celery_app
from django.db import connections, models, transaction
from django.test.utils import CaptureQueriesContext
from helpers import configure_django
from kombu import Producer
from psycopg import sql
from shipping import shipping
from waiting import wait_for

import celery_pgqueue.django
import kombu_pgqueue

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve()
EXAMPLE = HERE.parents[2] / "examples" / "django_project"
TABLE = f"pgqueue_test_order_{uuid.uuid4().hex[:10]}"


class Boom(Exception):
    """Raised inside an atomic block to roll it back."""


def _order_model(table: str) -> type[models.Model]:
    class Order(models.Model):
        item = models.CharField(max_length=50)

        class Meta:
            app_label = "pgqueue_tests"
            db_table = table

    return Order


@pytest.fixture(scope="module")
def order_model(dsn: str, other_database_dsn: str) -> Iterator[type[models.Model]]:
    configure_django(dsn, other_database_dsn)
    model = _order_model(TABLE)
    with connections["default"].schema_editor() as editor:
        editor.create_model(model)
    yield model
    with connections["default"].schema_editor() as editor:
        editor.delete_model(model)
    connections.close_all()


@pytest.fixture
def Order(order_model: type[models.Model]) -> Iterator[Any]:  # noqa: N802 - a model class
    yield order_model
    order_model.objects.all().delete()
    connections.close_all()


@pytest.fixture
def ship(app: Celery, dsn: str, Order: Any) -> Iterator[Any]:  # noqa: N803
    with shipping(app, dsn, sql.Identifier(TABLE)) as ship:
        yield ship


@pytest.fixture
def enlisted() -> Iterator[Callable[..., Callable[[], None]]]:
    undo: list[Callable[[], None]] = []

    def enlist(using: str = "default") -> Callable[[], None]:
        undo.append(celery_pgqueue.django.enlist_atomic(using))
        return undo[-1]

    yield enlist
    for u in undo:
        u()


# -- commit, rollback, savepoints -------------------------------------------------------


def test_commit_runs_the_task_after_the_order_is_committed(ship, Order, messages):  # noqa: N803
    conn = connections["default"]
    with transaction.atomic(), kombu_pgqueue.transaction(conn):
        order = Order.objects.create(item="book")
        with CaptureQueriesContext(conn) as queries:
            ship.delay(order.pk)
        # written by Django's cursor, in this transaction; nobody else sees it yet
        assert any("INSERT INTO" in q["sql"] and "message" in q["sql"] for q in queries)
        assert messages() == []
    assert ship.shipped.ran(order.pk) == {order.pk: True}


def test_rollback_leaves_no_message_and_no_run(ship, Order, messages):  # noqa: N803
    with pytest.raises(Boom), transaction.atomic():
        with kombu_pgqueue.transaction(connections["default"]):
            doomed = Order.objects.create(item="lamp")
            ship.delay(doomed.pk)
        raise Boom
    assert messages() == []
    assert not Order.objects.exists()
    # the worker is live: a task sent afterwards runs, and it is the only one
    with transaction.atomic(), kombu_pgqueue.transaction(connections["default"]):
        kept = Order.objects.create(item="pen")
        ship.delay(kept.pk)
    assert ship.shipped.ran(kept.pk) == {kept.pk: True}
    assert list(ship.shipped.seen) == [kept.pk]


def test_enlist_atomic_joins_every_atomic_block(ship, Order, messages, enlisted):  # noqa: N803
    enlisted()
    with transaction.atomic():
        outer = Order.objects.create(item="outer")
        ship.delay(outer.pk)
        with pytest.raises(Boom), transaction.atomic():  # a savepoint
            inner = Order.objects.create(item="inner")
            ship.delay(inner.pk)
            raise Boom
        after = Order.objects.create(item="after")
        ship.delay(after.pk)
        assert messages() == []
    assert ship.shipped.ran(outer.pk, after.pk) == {outer.pk: True, after.pk: True}
    assert inner.pk not in ship.shipped.seen
    assert sorted(Order.objects.values_list("item", flat=True)) == ["after", "outer"]


def test_enlist_atomic_outside_atomic_publishes_at_once(app, Order, messages, enlisted):  # noqa: N803
    enlisted()
    connections["default"].close()
    app.send_task("eco.ship", args=[1])
    # autocommit: through the broker's own connection; Django's was not even opened
    assert messages() == ["[1]"]
    assert connections["default"].connection is None


def test_enlist_atomic_ignores_another_databases_block(app, Order, messages, enlisted):  # noqa: N803
    enlisted("default")
    with transaction.atomic(using="elsewhere"):
        app.send_task("eco.ship", args=[2])
        assert messages() == ["[2]"]


def test_publish_errors_are_pgqueues_own(app, Order, messages):  # noqa: N803
    # Django re-raises psycopg's DataError as its own; the caller still gets pgqueue's
    with transaction.atomic(), kombu_pgqueue.transaction(connections["default"]):
        with app.connection_for_write() as conn, pytest.raises(kombu_pgqueue.MessageError):
            Producer(conn).publish(
                "x", routing_key="celery", content_type="text/\x00", content_encoding="utf-8"
            )
        Order.objects.create(item="still usable")
    assert messages() == []
    assert Order.objects.count() == 1


# -- crash, other databases ------------------------------------------------------------


def test_producer_dying_before_commit_leaves_neither(
    dsn,
    other_database_dsn,
    schema,
    app,
    Order,
    db,
    messages,  # noqa: N803
):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[2]), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(HERE), dsn, schema, TABLE, other_database_dsn],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 3, (done.stdout, done.stderr)
    said, backend_pid, seen_orders, seen_messages = done.stdout.split()
    assert said == "published"
    # inside its transaction the producer saw its order and its task
    assert (seen_orders, seen_messages) == ("1", "1")

    def backend_gone() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        row = db.execute(query, (int(backend_pid),))
        return row.fetchone() == (0,)

    wait_for(backend_gone, 15, "the dead producer's session to end")
    assert not Order.objects.exists()
    assert messages() == []


def test_another_database_raises_configuration_error(app, Order, messages, enlisted, schema):  # noqa: N803
    with transaction.atomic(using="elsewhere"):
        with kombu_pgqueue.transaction(connections["elsewhere"]):
            with pytest.raises(kombu_pgqueue.ConfigurationError, match=schema):
                app.send_task("eco.ship", args=[4])
    enlisted("elsewhere")
    with transaction.atomic(using="elsewhere"):
        with pytest.raises(kombu_pgqueue.ConfigurationError, match="on_commit"):
            app.send_task("eco.ship", args=[5])
    assert messages() == []


def test_on_commit_is_the_fallback_for_another_database(app, Order, messages):  # noqa: N803
    def publish(n: int) -> Callable[[], object]:
        return lambda: app.send_task("eco.ship", args=[n])

    with pytest.raises(Boom), transaction.atomic(using="elsewhere"):
        transaction.on_commit(publish(6), using="elsewhere")
        raise Boom
    with transaction.atomic(using="elsewhere"):
        transaction.on_commit(publish(7), using="elsewhere")
        assert messages() == []
    assert messages() == ["[7]"]


def test_sqlite_is_refused(Order, enlisted):  # noqa: N803
    with pytest.raises(kombu_pgqueue.ConfigurationError, match="sqlite"):
        enlisted("lite")
    with pytest.raises(kombu_pgqueue.ConfigurationError, match="sqlite"):
        with kombu_pgqueue.transaction(connections["lite"]):
            pass


def test_dsn_names_djangos_database(Order, db):  # noqa: N803
    with psycopg.connect(celery_pgqueue.django.dsn()) as conn:
        assert conn.info.dbname == db.info.dbname
        assert conn.execute("SELECT to_regclass(%s) IS NOT NULL", (TABLE,)).fetchone() == (True,)


# -- the example project ---------------------------------------------------------------


def test_example_project_demo(dsn, schema):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "manage.py"), "demo"],
        env={**os.environ, "PGQUEUE_DSN": dsn, "PGQUEUE_SCHEMA": schema},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "4/4 checks passed" in done.stdout, (done.stdout, done.stderr)


def _crash_producer(dsn: str, schema: str, table: str, elsewhere: str) -> None:
    """Create an order and enqueue its task in one atomic block, then die before commit."""
    configure_django(dsn, elsewhere)
    order_model: Any = _order_model(table)
    celery_pgqueue.django.enlist_atomic()
    app = celery_app(dsn, schema, main="crash", results=False)
    conn = connections["default"]
    with transaction.atomic():
        order = order_model.objects.create(item="doomed")
        app.send_task("eco.ship", args=[order.pk])
        with conn.cursor() as cur:
            cur.execute(
                sql.SQL("SELECT count(*) FROM {}.message_store").format(sql.Identifier(schema))
            )
            (seen_messages,) = cur.fetchone()
        seen_orders = order_model.objects.count()
        pid = conn.connection.info.backend_pid
        print("published", pid, seen_orders, seen_messages, flush=True)
        os._exit(3)


if __name__ == "__main__":
    _crash_producer(*sys.argv[1:5])
