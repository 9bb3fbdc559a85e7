"""A publisher whose database turns read-only, stops or hangs: Kombu's retry policy
applies, errors are connection errors that name the cause, and a later publish works
at once when the server is back. Each test runs on a throwaway cluster of its own."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import kombu.exceptions
import pytest
from clusters import Cluster
from kombu import Connection, Producer, Queue
from psycopg import sql
from waiting import wait_for

import kombu_pgqueue

SCHEMA = "faults"


def _url(*clusters: Cluster, **query: str) -> str:
    hosts = ",".join("127.0.0.1" for _ in clusters)
    ports = ",".join(str(c.port) for c in clusters)
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"pgqueue+postgresql://postgres@/postgres?host={hosts}&port={ports}{extra}"


@pytest.fixture
def connect() -> Iterator[Callable[..., Connection]]:
    made: list[Connection] = []

    def connect(url: str, **options: Any) -> Connection:
        conn = Connection(url, transport_options={"schema": SCHEMA, **options})
        made.append(conn)
        return conn

    yield connect
    for conn in made:
        conn.release()


def _publish(conn: Connection, body: Any, **policy: Any) -> None:
    Producer(conn).publish(
        body,
        routing_key="q",
        declare=[Queue("q")],
        retry=True,
        retry_policy={"interval_start": 0, "interval_step": 0.2, "interval_max": 0.5, **policy},
    )


def _size(cluster: Cluster) -> int:
    with cluster.connect() as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.message WHERE queue = %s").format(
                sql.Identifier(SCHEMA)
            ),
            ["q"],
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_read_only_database_is_a_connection_error_and_the_policy_retries(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(_url(primary))
    _publish(conn, "before")
    primary.set_read_only(True)

    with pytest.raises(kombu.exceptions.OperationalError, match="read-only"):
        _publish(conn, "refused", max_retries=2)

    primary.set_read_only(False)
    _publish(conn, "after", max_retries=2)
    assert _size(primary) == 2


def test_a_publish_waits_out_a_read_only_spell_when_its_policy_says_so(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(_url(primary))
    _publish(conn, "before")
    primary.set_read_only(True)
    refused = threading.Event()
    done: list[BaseException | None] = []

    def publish() -> None:
        try:
            _publish(conn, "waited", max_retries=None, errback=lambda exc, _: refused.set())
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            done.append(exc)

    thread = threading.Thread(target=publish)
    thread.start()
    wait_for(refused, 30, "the publish to be refused once")
    primary.set_read_only(False)
    thread.join(30)

    assert done == [None]
    assert _size(primary) == 2


@pytest.mark.timeout(25)
def test_a_stopped_server_fails_the_publish_promptly_and_the_next_one_works_once_back(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(_url(primary), pool_timeout=30)
    _publish(conn, "before")
    primary.stop("immediate")

    # a pool timeout (30 s) would fail the test by its own timeout (see the marker)
    with pytest.raises(kombu.exceptions.OperationalError, match=str(primary.port)):
        _publish(conn, "refused", max_retries=1)

    primary.start()
    _publish(conn, "after", max_retries=0)
    assert _size(primary) == 2


@pytest.mark.timeout(40)
def test_a_hung_server_fails_the_publish_within_the_statement_timeout(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(_url(primary), statement_timeout=1)
    _publish(conn, "before")
    primary.pause()

    try:
        with pytest.raises(kombu.exceptions.OperationalError, match="did not answer"):
            _publish(conn, "hung", max_retries=0)
    finally:
        primary.resume()

    _publish(conn, "after", max_retries=1)
    assert _size(primary) >= 2  # "hung" may have committed before the server stopped


def test_a_consumer_pointed_at_a_standby_gets_a_connection_error_naming_it(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
    connect: Callable[..., Connection],
) -> None:
    primary, standby = primary_and_standby()
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    wait_for(
        lambda: _size(standby) == 0,
        30,
        "the schema on the standby",
        ignore=(Exception,),
    )
    conn = connect(_url(standby))

    with pytest.raises(kombu.exceptions.OperationalError, match="read-only") as raised:
        conn.ensure_connection(max_retries=1, interval_start=0)
    assert str(standby.port) in str(raised.value)


def test_migrate_on_a_standby_says_so_in_one_line(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
) -> None:
    _, standby = primary_and_standby()

    done = subprocess.run(
        [sys.executable, "-m", "kombu_pgqueue", "migrate", "--dsn", standby.dsn],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "read-only" in done.stderr and "primary" in done.stderr


@pytest.mark.timeout(60)
def test_a_commit_stuck_on_a_gone_synchronous_standby_raises_and_is_kept_once(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
    connect: Callable[..., Connection],
) -> None:
    primary, standby = primary_and_standby(synchronous=True)
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(_url(primary), statement_timeout=1)
    _publish(conn, "before")
    standby.stop("immediate")  # every commit now waits for it

    with pytest.raises(kombu.exceptions.OperationalError, match="synchronous standby"):
        _publish(conn, "stuck", max_retries=0)

    standby.start()
    _publish(conn, "after", max_retries=3)
    # "stuck" committed locally before its wait: the caller was told it failed, and it
    # is there once (a retry by the caller would be a new publish call)
    assert _size(primary) == 3
