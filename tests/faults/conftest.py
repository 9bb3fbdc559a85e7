"""Fixtures for fault tests: throwaway PostgreSQL clusters (``tests/clusters.py``) that a
test may crash, promote, hang or make read-only without touching the shared server.

* ``primary``: a fresh primary for the test, destroyed after it.
* ``primary_and_standby``: a factory, ``primary_and_standby(synchronous=True)``, that
  returns a new primary and a streaming standby; both are destroyed after the test.
* ``connect``: ``connect(url, connect_timeout=5, **transport_options)``, a Kombu
  connection on schema ``faults`` (see ``publishing.py``), released after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from clusters import Cluster
from kombu import Connection
from publishing import SCHEMA


@pytest.fixture
def primary() -> Iterator[Cluster]:
    with Cluster.primary() as cluster:
        yield cluster


@pytest.fixture
def primary_and_standby() -> Iterator[Callable[..., tuple[Cluster, Cluster]]]:
    made: list[Cluster] = []

    def make(*, synchronous: bool = False) -> tuple[Cluster, Cluster]:
        primary = Cluster.primary()
        made.append(primary)  # its destroy() takes its standbys with it
        return primary, primary.standby(synchronous=synchronous)

    yield make
    for cluster in made:
        cluster.destroy()


@pytest.fixture
def connect() -> Iterator[Callable[..., Connection]]:
    """``connect(url, **transport_options)``: a Kombu connection on schema ``faults``,
    released after the test."""
    made: list[Connection] = []

    def connect(url: str, *, connect_timeout: float = 5, **options: Any) -> Connection:
        conn = Connection(
            url,
            connect_timeout=connect_timeout,
            transport_options={"schema": SCHEMA, **options},
        )
        made.append(conn)
        return conn

    yield connect
    for conn in made:
        conn.release()
