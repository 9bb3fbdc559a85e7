"""``celery_pgqueue.configure()`` on first use (from the same issue as the archive): it
takes a ``pgqueue://`` broker URL as well as a libpq DSN, and the result backend's URL
is a normal one (the host where URLs put it), which connects as libpq would."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.engine import make_url

import celery_pgqueue


def configured(dsn: str, **options: Any) -> Celery:
    app = Celery(set_as_current=False)
    celery_pgqueue.configure(app, dsn, **options)
    return app


def connects_with(result_backend: str) -> dict[str, str]:
    """The libpq parameters SQLAlchemy's psycopg dialect connects with for this URL."""
    _, params = psycopg_dialect().create_connect_args(make_url(result_backend.removeprefix("db+")))
    params.pop("context", None)  # the dialect's type adapters, not a connection parameter
    return {key: str(value) for key, value in params.items()}


@pytest.mark.parametrize(
    "dsn, url",
    [
        ("postgresql://app:pw@db.internal:5433/jobs", "postgresql+psycopg://app:pw@db.internal:5433/jobs"),
        ("host=db.internal dbname=jobs user=app", "postgresql+psycopg://app@db.internal/jobs"),
        ("postgresql://app@db.internal/jobs?sslmode=require",
         "postgresql+psycopg://app@db.internal/jobs?sslmode=require"),
        ("postgresql://app@[2001:db8::1]:5432/jobs", "postgresql+psycopg://app@[2001:db8::1]:5432/jobs"),
        # a socket directory cannot be a URL's host: the query string, as SQLAlchemy reads it
        ("host=/var/run/postgresql port=5433 dbname=jobs user=app",
         "postgresql+psycopg://app@/jobs?host=%2Fvar%2Frun%2Fpostgresql&port=5433"),
        ("postgresql:///jobs?host=/tmp", "postgresql+psycopg:///jobs?host=%2Ftmp"),
    ],
)  # fmt: skip
def test_result_backend_url_puts_one_host_where_urls_put_it(dsn: str, url: str) -> None:
    assert celery_pgqueue.result_backend_url(dsn) == "db+" + url


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:p%40ss@db.internal:5433/jobs",
        "host=db.internal dbname=jobs user=app sslmode=require application_name=reports",
        "postgresql://app@[2001:db8::1]:5432/jobs",
        "host=/var/run/postgresql port=5433 dbname=jobs user=app",
        "host=/tmp dbname=jobs",
        "host=h1,h2 port=5432,5433 dbname=jobs user=app password=pw",
        "postgresql://app@h1:5432,h2:5433/jobs?target_session_attrs=read-write",
    ],
)
def test_result_backend_url_connects_as_libpq_would(dsn: str) -> None:
    expected = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    assert connects_with(celery_pgqueue.result_backend_url(dsn)) == expected


@pytest.mark.parametrize(
    "url, results",
    [
        ("pgqueue://app:pw@db.internal:5433/jobs", "postgresql+psycopg://app:pw@db.internal:5433/jobs"),
        ("pgqueue://app@%2Fvar%2Frun%2Fpostgresql/jobs",
         "postgresql+psycopg://app@/jobs?host=%2Fvar%2Frun%2Fpostgresql"),
        ("pgqueue+postgresql://app@db.internal/jobs?sslmode=require",
         "postgresql+psycopg://app@db.internal/jobs?sslmode=require"),
        # a failover list: the transport moves along it; the results use its first URL
        ("pgqueue://db1:5432/jobs;pgqueue://db2:5432/jobs", "postgresql+psycopg://db1:5432/jobs"),
    ],
)  # fmt: skip
def test_configure_keeps_a_broker_url_and_puts_the_results_on_its_database(
    url: str, results: str
) -> None:
    app = configured(url)

    assert app.conf.broker_url == url
    # without the session keywords the transport adds for its own pool
    assert app.conf.result_backend == "db+" + results


def test_configure_gives_libpq_transport_options_to_the_results_too() -> None:
    app = configured("pgqueue://app@db.internal/jobs", sslmode="require", schema="jobs")

    assert app.conf.result_backend == "db+postgresql+psycopg://app@db.internal/jobs?sslmode=require"
    assert app.conf.broker_transport_options == {"sslmode": "require", "schema": "jobs"}


def test_configure_turns_the_failed_task_archive_on_or_off() -> None:
    assert configured("pgqueue://db/jobs", keep_failed=True).conf.pgqueue_keep_failed is True
    assert configured("pgqueue://db/jobs", keep_failed=False).conf.pgqueue_keep_failed is False
    app = Celery(set_as_current=False)
    app.conf.pgqueue_keep_failed = True
    celery_pgqueue.configure(app, "pgqueue://db/jobs")  # None: the setting stays
    assert app.conf.pgqueue_keep_failed is True


def test_configure_with_the_test_databases_broker_url_reaches_broker_and_results(
    broker_base_url: str, schema: str
) -> None:
    app = configured(broker_base_url, schema=schema)
    try:
        assert app.conf.broker_url == broker_base_url
        with Connection(app.conf.broker_url, transport_options={"schema": schema}) as conn:
            conn.connect()
            queue = conn.SimpleQueue("configured")
            queue.put({"n": 1})
            assert queue.get(timeout=10).payload == {"n": 1}
            queue.close()
        task_id = str(uuid.uuid4())
        app.backend.store_result(task_id, 42, "SUCCESS")
        assert app.AsyncResult(task_id).get(timeout=10) == 42
    finally:
        app.close()
