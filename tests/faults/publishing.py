"""What the publisher fault tests share: the URL of throwaway clusters, a publish with
a retry policy, and the count of what was stored (``tests/faults/test_publish*.py``).
The ``connect`` fixture that opens Kombu connections on them is in ``conftest.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from clusters import Cluster
from kombu import Connection, Producer, Queue
from psycopg import sql
from waiting import wait_for

SCHEMA = "faults"

#: a quick policy; tests add ``max_retries`` and ``errback``
QUICK_POLICY = {"interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


def url(*clusters: Cluster, **query: str) -> str:
    """A ``pgqueue+postgresql://`` URL naming every cluster (a libpq multi-host URL)."""
    hosts = ",".join("127.0.0.1" for _ in clusters)
    ports = ",".join(str(c.port) for c in clusters)
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"pgqueue+postgresql://postgres@/postgres?host={hosts}&port={ports}{extra}"


def publish(conn: Connection, body: Any, **policy: Any) -> None:
    """Publish ``body`` to queue ``q`` with Kombu's retry, :data:`QUICK_POLICY` and ``policy``."""
    Producer(conn).publish(
        body,
        routing_key="q",
        declare=[Queue("q")],
        retry=True,
        retry_policy={**QUICK_POLICY, **policy},
    )


def size(cluster: Cluster, queue: str = "q") -> int:
    """Messages waiting in ``queue`` of :data:`SCHEMA` on ``cluster``."""
    with cluster.connect() as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.message_store WHERE queue = %s").format(
                sql.Identifier(SCHEMA)
            ),
            [queue],
        ).fetchone()
    assert row is not None
    return int(row[0])


class Background:
    """``call()`` on a thread of its own: :meth:`outcome` waits for it to end and
    returns what it raised (None if it returned)."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.ended = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                self.error = exc
            finally:
                self.ended.set()

        threading.Thread(target=run, daemon=True).start()

    def outcome(self, timeout: float, what: str = "the publish to end") -> BaseException | None:
        wait_for(self.ended, timeout, what)
        return self.error
