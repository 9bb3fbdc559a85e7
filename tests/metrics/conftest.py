"""Fixtures for the metrics tests: a monitor on the test schema, and Prometheus text read
back into numbers."""

from __future__ import annotations

import pytest
from kombu import Connection

from kombu_pgqueue._monitor import Monitor


@pytest.fixture
def monitor(connection: Connection) -> Monitor:
    return Monitor(connection.default_channel.store)
