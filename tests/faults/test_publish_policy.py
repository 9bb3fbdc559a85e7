"""A publish follows the retry policy it was given, whatever the server does: stopped
(the policy waits, past Kombu's and Celery's connect timeout), hung (each attempt ends
within ``publish_timeout``), full (raised at once: no reconnect fixes a disk). Each
test runs on a throwaway cluster of its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from clusters import Cluster
from failover_app import make_app
from kombu import Connection
from publishing import SCHEMA, Background, publish, size, url
from waiting import wait_for

import kombu_pgqueue

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
