"""embedded.broker_url: a libpq DSN in, a pgqueue:// URL that Kombu reads back the same out."""

from __future__ import annotations

import pytest
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// alias
from kombu_pgqueue.embedded import broker_url


def _as_kombu_reads_it(url: str) -> dict[str, str]:
    # the conninfo the transport would connect with (no connection is made)
    conn = Connection(url)
    try:
        params = conninfo_to_dict(conn.transport.store.conninfo)
    finally:
        conn.release()
    params.pop("application_name", None)
    params.pop("connect_timeout", None)
    return params


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("host=127.0.0.1 dbname=test user=postgres", "pgqueue://postgres@127.0.0.1/test"),
        ("host=db port=5433 dbname=jobs user=app", "pgqueue://app@db:5433/jobs"),
        ("postgresql://app:pw@db:5433/jobs", "pgqueue://app:pw@db:5433/jobs"),
        (
            "postgresql://postgres:@/postgres?host=/tmp/pgqueue-pg-x",
            "pgqueue://postgres@%2Ftmp%2Fpgqueue-pg-x/postgres",
        ),
    ],
)
def test_broker_url_builds_pgqueue_urls(dsn: str, expected: str) -> None:
    assert broker_url(dsn) == expected


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 dbname=test user=postgres",
        "host=db port=5433 dbname=jobs user=app password=s3cr@t/;x",
        "postgresql://app:p%40ss%2Fw@db:5433/jobs",
        "postgresql://postgres:@/postgres?host=/tmp/pgqueue-pg-x",
        "host=/var/run/PostgreSQL user=ünï dbname=my%db",
        "postgresql://app@db/jobs?sslmode=require&application_name=x",
        "host=/tmp/sock user=u dbname=d sslmode=disable",
        "postgresql://app@h1:5432,h2:5433/jobs?target_session_attrs=read-write",
        "host=h1,h2 port=5432,5433 dbname=jobs user=app",
    ],
)
def test_broker_url_round_trips_through_kombu(dsn: str) -> None:
    expected = {k: v for k, v in conninfo_to_dict(dsn).items() if v not in ("", None)}
    expected.pop("application_name", None)

    assert _as_kombu_reads_it(broker_url(dsn)) == expected


def test_broker_url_keeps_extra_libpq_options_in_libpq_form() -> None:
    url = broker_url("postgresql://app@db/jobs?sslmode=require")

    assert url.startswith("pgqueue+postgresql://")
    assert "sslmode=require" in url


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:pw@h1:5432,h2:5433/jobs?target_session_attrs=read-write",
        "host=h1,h2 port=5432,5433 dbname=jobs user=app password=pw",
    ],
)
def test_configure_takes_a_multi_host_dsn_for_broker_and_results(dsn: str) -> None:
    from celery import Celery
    from sqlalchemy.engine import make_url

    import celery_pgqueue

    app = Celery(set_as_current=False)
    celery_pgqueue.configure(app, dsn)

    assert _as_kombu_reads_it(app.conf.broker_url)["host"] == "h1,h2"
    backend = make_url(app.conf.result_backend.removeprefix("db+"))
    assert backend.query["host"] == ("h1:5432", "h2:5433")
    assert (backend.database, backend.username) == ("jobs", "app")
