"""A publisher whose database turns read-only, stops or hangs: Kombu's retry policy
applies, errors are connection errors that name the cause, and a later publish works
at once when the server is back. Each test runs on a throwaway cluster of its own."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import kombu.exceptions
import pytest
from clusters import Cluster
from kombu import Connection
from publishing import SCHEMA, Background, publish, size, url
from waiting import wait_for

import kombu_pgqueue


def test_a_read_only_database_is_a_connection_error_and_the_policy_retries(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary))
    publish(conn, "before")
    primary.set_read_only(True)

    with pytest.raises(kombu.exceptions.OperationalError, match="read-only"):
        publish(conn, "refused", max_retries=2)

    primary.set_read_only(False)
    publish(conn, "after", max_retries=2)
    assert size(primary) == 2


def test_a_publish_waits_out_a_read_only_spell_when_its_policy_says_so(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary))
    publish(conn, "before")
    primary.set_read_only(True)
    refused = threading.Event()

    waited = Background(
        lambda: publish(conn, "waited", max_retries=None, errback=lambda exc, _: refused.set())
    )
    wait_for(refused, 30, "the publish to be refused once")
    primary.set_read_only(False)

    assert waited.outcome(30) is None
    assert size(primary) == 2


@pytest.mark.timeout(25)
def test_a_stopped_server_fails_the_publish_promptly_and_the_next_one_works_once_back(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary), pool_timeout=30)
    publish(conn, "before")
    primary.stop("immediate")

    # a pool timeout (30 s) would fail the test by its own timeout (see the marker)
    with pytest.raises(kombu.exceptions.OperationalError, match=str(primary.port)):
        publish(conn, "refused", max_retries=1)

    primary.start()
    publish(conn, "after", max_retries=0)
    assert size(primary) == 2


@pytest.mark.timeout(40)
def test_a_hung_server_fails_the_publish_within_the_statement_timeout(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary), statement_timeout=1)
    publish(conn, "before")
    primary.pause()

    try:
        with pytest.raises(kombu.exceptions.OperationalError, match="did not answer"):
            publish(conn, "hung", max_retries=0)
    finally:
        primary.resume()

    publish(conn, "after", max_retries=1)
    assert size(primary) >= 2  # "hung" may have committed before the server stopped


def test_a_consumer_pointed_at_a_standby_gets_a_connection_error_naming_it(
    primary_and_standby: Callable[..., tuple[Cluster, Cluster]],
    connect: Callable[..., Connection],
) -> None:
    primary, standby = primary_and_standby()
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    wait_for(
        lambda: size(standby) == 0,
        30,
        "the schema on the standby",
        ignore=(Exception,),
    )
    conn = connect(url(standby))

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
    conn = connect(url(primary), statement_timeout=1)
    publish(conn, "before")
    standby.stop("immediate")  # every commit now waits for it

    with pytest.raises(kombu.exceptions.OperationalError, match="synchronous standby"):
        publish(conn, "stuck", max_retries=0)

    standby.start()
    publish(conn, "after", max_retries=3)
    # "stuck" committed locally before its wait: the caller was told it failed, and it
    # is there once (a retry by the caller would be a new publish call)
    assert size(primary) == 3
