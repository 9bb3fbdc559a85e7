"""Connection.connect, failures Kombu can retry on, and failover URL lists."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import kombu.exceptions
import psycopg
import pytest
from kombu import Connection

from kombu_pgqueue.transport import Transport

DOWN_URL = "pgqueue://postgres@127.0.0.1:1/test"  # nothing listens on port 1


@pytest.fixture
def made() -> Iterator[list[Connection]]:
    connections: list[Connection] = []
    yield connections
    for conn in connections:
        conn.release()


def _conn(made: list[Connection], url: str, **options: object) -> Connection:
    conn = Connection(url, transport_options=options, connect_timeout=2)
    made.append(conn)
    return conn


def test_connect_opens_a_pgqueue_transport(connection: Connection) -> None:
    assert connection.connected
    assert isinstance(connection.transport, Transport)
    assert connection.transport.driver_type == "pgqueue"
    assert connection.transport.driver_version() == psycopg.__version__


def test_connection_errors_include_psycopg_operational_error(connection: Connection) -> None:
    assert psycopg.OperationalError in connection.connection_errors
    assert psycopg.OperationalError in connection.recoverable_connection_errors
    assert psycopg.InterfaceError in connection.connection_errors


def test_connect_to_a_missing_database_raises_operational_error(
    made: list[Connection], url_with: Callable[..., str], schema: str
) -> None:
    conn = _conn(made, url_with(dbname="pgqueue_no_such_db"), schema=schema)

    with pytest.raises(psycopg.OperationalError, match="pgqueue_no_such_db"):
        conn.connect()
    assert not conn.connected


def test_connect_to_a_server_that_is_down_raises_operational_error(
    made: list[Connection], schema: str
) -> None:
    conn = _conn(made, DOWN_URL, schema=schema)

    with pytest.raises(psycopg.OperationalError):
        conn.connect()
    assert not conn.connected


def test_ensure_connection_gives_up_with_kombu_operational_error(
    made: list[Connection], schema: str
) -> None:
    conn = _conn(made, DOWN_URL, schema=schema)
    failures: list[BaseException] = []

    with pytest.raises(kombu.exceptions.OperationalError) as caught:
        conn.ensure_connection(
            errback=lambda exc, interval: failures.append(exc),
            max_retries=2,
            interval_start=0,
            interval_step=0,
            interval_max=0,
        )

    assert isinstance(caught.value.__cause__, psycopg.OperationalError)
    assert len(failures) == 2
    assert all(isinstance(exc, psycopg.OperationalError) for exc in failures)


def test_failover_list_connects_to_the_live_server(
    made: list[Connection], url_with: Callable[..., str], db: psycopg.Connection, schema: str
) -> None:
    # Kombu's Connection.switch() keeps the previous URL's port when the next one
    # names none, so the documented form gives every alternate its port
    port = db.execute("SHOW port").fetchone()[0]  # type: ignore[index]
    conn = _conn(made, f"{DOWN_URL};{url_with(port=port)}", schema=schema)

    conn.connect()

    assert conn.connected
    queue = conn.SimpleQueue("failover")
    queue.put({"via": "second host"})
    assert queue.get(timeout=5).payload == {"via": "second host"}
    queue.close()


def test_failover_list_with_ensure_connection_reports_the_dead_host(
    made: list[Connection], url_with: Callable[..., str], db: psycopg.Connection, schema: str
) -> None:
    port = db.execute("SHOW port").fetchone()[0]  # type: ignore[index]
    conn = _conn(made, f"{DOWN_URL};{url_with(port=port)}", schema=schema)
    failures: list[BaseException] = []

    conn.ensure_connection(
        errback=lambda exc, interval: failures.append(exc),
        max_retries=3,
        interval_start=0,
        interval_step=0,
        interval_max=0,
    )

    assert conn.connected
    assert [type(exc) for exc in failures] == [psycopg.OperationalError]
    conn.Producer().publish({"n": 1}, routing_key="failover-ensure")
    message = conn.default_channel.basic_get("failover-ensure")
    assert message is not None and message.payload == {"n": 1}
    message.ack()


def test_release_closes_and_a_new_connection_works(
    make_connection: Callable[..., Connection],
) -> None:
    first = make_connection()
    first.SimpleQueue("reconnect").put("kept")
    first.release()

    second = make_connection()
    queue = second.SimpleQueue("reconnect")
    assert queue.get(timeout=5).payload == "kept"
    queue.close()
