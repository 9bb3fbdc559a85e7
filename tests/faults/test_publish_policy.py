"""A publish follows the retry policy it was given, whatever the server does: stopped
(the policy waits, past Kombu's and Celery's connect timeout), hung (each attempt ends
within ``publish_timeout``), full (raised at once: no reconnect fixes a disk). Each
test runs on a throwaway cluster of its own."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import kombu.exceptions
import pytest
from clusters import Cluster
from failover_app import make_app
from kombu import Connection
from psycopg import sql
from publishing import SCHEMA, Background, publish, size, url
from waiting import wait_for

import kombu_pgqueue
from kombu_pgqueue.exceptions import ResourceError

#: seconds Kombu's own connect loop may take before a publish's retry policy starts
CONNECT_TIMEOUT = 1.0


class Refusals:
    """The errback of a retry policy: when the publish was last refused."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last = self.started
        self.seen = threading.Event()

    def __call__(self, exc: BaseException, interval: float) -> None:
        self.last = time.monotonic()
        self.seen.set()

    def outlived(self, seconds: float) -> bool:
        """Whether the publish was still being retried ``seconds`` after it started."""
        return self.last - self.started > seconds


def _wait_out_a_stop(primary: Cluster, refusals: Refusals, publishing: Background) -> None:
    """The server comes back once the publish has been retried for three times
    Kombu's connect timeout (where it used to give up): the publish must then succeed."""
    wait_for(
        lambda: publishing.ended.is_set() or refusals.outlived(3 * CONNECT_TIMEOUT),
        60,
        "the publish to outlive the connect timeout, or to end",
    )
    assert not publishing.ended.is_set(), f"gave up against its policy: {publishing.error!r}"
    primary.start()
    assert publishing.outcome(60) is None
    assert size(primary) == 1


@pytest.mark.timeout(90)
def test_a_celery_publish_with_unbounded_retries_waits_for_a_stopped_server(
    primary: Cluster,
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    app = make_app(url(primary), SCHEMA)
    app.conf.broker_connection_timeout = CONNECT_TIMEOUT
    primary.stop("immediate")
    refusals = Refusals()

    publishing = Background(
        lambda: app.send_task(
            "failover.record",
            ["waited"],
            queue="q",
            retry=True,
            retry_policy={"max_retries": None, "errback": refusals},
        )
    )

    _wait_out_a_stop(primary, refusals, publishing)


@pytest.mark.timeout(90)
def test_a_kombu_publish_retries_as_many_times_as_its_policy_says(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary), connect_timeout=CONNECT_TIMEOUT)
    primary.stop("immediate")
    refusals = Refusals()
    policy: dict[str, Any] = {
        "max_retries": 5,
        "interval_start": 0,
        "interval_step": 1,
        "interval_max": 3,
        "errback": refusals,
    }

    publishing = Background(lambda: publish(conn, "waited", **policy))

    _wait_out_a_stop(primary, refusals, publishing)


#: the publish_timeout of the hung-server tests, and the margin its bound is held to
PUBLISH_TIMEOUT, MARGIN = 2.0, 1.5


def _raises_within_the_bound(call: Callable[[], object]) -> BaseException:
    started = time.monotonic()
    with pytest.raises(kombu.exceptions.OperationalError) as raised:
        call()
    took = time.monotonic() - started
    assert took < PUBLISH_TIMEOUT + MARGIN, f"took {took:.1f} s: {raised.value}"
    return raised.value


@pytest.mark.timeout(60)
def test_a_publish_on_a_hung_server_raises_within_publish_timeout(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary), publish_timeout=PUBLISH_TIMEOUT)
    publish(conn, "before")  # its pooled connection stays open
    primary.pause()

    try:
        error = _raises_within_the_bound(lambda: publish(conn, "hung", max_retries=0))
    finally:
        primary.resume()

    assert "did not answer" in str(error) and "publish_timeout" in str(error)
    publish(conn, "after", max_retries=1)
    assert size(primary) >= 2  # "hung" may have committed before the server stopped


@pytest.mark.timeout(60)
def test_a_new_publisher_of_a_hung_server_raises_within_publish_timeout(
    primary: Cluster, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary), connect_timeout=10, publish_timeout=PUBLISH_TIMEOUT)
    primary.pause()

    try:
        _raises_within_the_bound(lambda: publish(conn, "hung", max_retries=0))
    finally:
        primary.resume()

    publish(conn, "after", max_retries=1)
    assert size(primary) == 1


class SmallDisk:
    """A tablespace on a 4 MB tmpfs of its own, the database's default one: what
    pgqueue installs afterwards lives there, and :meth:`fill` leaves it no room."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.mount = cluster.root / "small"
        self.mount.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(self.mount)], check=True
        )
        if os.geteuid() == 0:
            subprocess.run(["chown", "postgres:postgres", str(self.mount)], check=True)
        with cluster.connect() as conn:
            location = sql.Literal(str(self.mount))
            conn.execute(sql.SQL("CREATE TABLESPACE small LOCATION {}").format(location))
            conn.execute("ALTER DATABASE postgres SET default_tablespace = small")
        self.filler = self.mount / "filler"

    def fill(self) -> None:
        """Write a file until the file system has no room left."""
        chunk = b"\0" * 65536
        with open(self.filler, "ab", buffering=0) as out:
            while True:
                try:
                    out.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return
                    chunk = chunk[: len(chunk) // 2]

    def free(self) -> None:
        self.filler.unlink()

    def unmount(self) -> None:
        # lazily: the server may hold its files open until it stops
        subprocess.run(["umount", "-l", str(self.mount)], check=False)


@pytest.fixture
def small_disk(primary: Cluster) -> Iterator[SmallDisk]:
    if os.geteuid() != 0:
        # a database test never skips in CI: there it fails, naming what it needs
        why = "mounting a small file system takes root"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs as root", pytrace=False)
        pytest.skip(why)
    disk = SmallDisk(primary)
    yield disk
    disk.unmount()


def _disk_full_errors(cluster: Cluster) -> int:
    """ERROR lines in the server's log that say the disk is full."""
    lines = cluster.log().splitlines()
    return sum(1 for line in lines if "ERROR:" in line and "No space left on device" in line)


def test_a_full_disk_fails_a_publish_at_once_without_retries(
    primary: Cluster, small_disk: SmallDisk, connect: Callable[..., Connection]
) -> None:
    kombu_pgqueue.migrate(primary.dsn, SCHEMA)
    conn = connect(url(primary))
    publish(conn, "before")
    small_disk.fill()
    refusals = Refusals()
    errors_before = _disk_full_errors(primary)

    # incompressible, so that its TOAST rows need pages the disk does not have
    with pytest.raises(ResourceError) as raised:
        publish(conn, os.urandom(1 << 20), max_retries=3, errback=refusals)

    assert _disk_full_errors(primary) - errors_before == 1  # one attempt, no retry
    assert not refusals.seen.is_set()
    text = str(raised.value)
    assert "\n" not in text and "disk" in text and "No space left on device" in text
    small_disk.free()
    publish(conn, "after", max_retries=0)
    assert size(primary) == 2
