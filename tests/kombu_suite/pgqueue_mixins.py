"""Kombu's integration mixins (``t/integration/common.py`` of the installed Kombu) on a
pgqueue connection: copied into the downloaded suite as ``t/integration/test_pgqueue.py``
by ``tests/kombu_suite/run.py``, beside Kombu's own ``test_py_amqp.py``, which runs the
same mixins on RabbitMQ. Not collected by this project's own pytest run (no ``test_``
prefix here); its imports resolve only inside Kombu's suite."""

from __future__ import annotations

import os
import socket

import kombu
import pytest

import kombu_pgqueue  # noqa: F401  (registers the pgqueue:// scheme with Kombu)

from .common import (  # type: ignore[import-not-found]
    BaseEventLoop,
    BaseExchangeTypes,
    BaseFailover,
    BaseMessage,
    BasePriority,
    BaseTimeToLive,
    BasicFunctionality,
)

#: a pgqueue:// URL of the broker database, set by run.py (a fresh database each run)
URL = os.environ["PGQUEUE_SUITE_URL"]


def _dead_port() -> int:
    """A port nothing listens on: bound, never listened on, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dead_url() -> str:
    # the live URL with its port replaced: same scheme, user and database
    head, _, tail = URL.partition("@")
    hostport, _, db = tail.partition("/")
    host = hostport.rsplit(":", 1)[0] if ":" in hostport else hostport
    return f"{head}@{host}:{_dead_port()}/{db}"


@pytest.fixture()
def connection() -> kombu.Connection:
    return kombu.Connection(URL)


@pytest.fixture()
def invalid_connection() -> kombu.Connection:
    return kombu.Connection(_dead_url(), connect_timeout=1)


@pytest.fixture()
def failover_connection() -> kombu.Connection:
    return kombu.Connection(f"{_dead_url()};{URL}", connect_timeout=1)


class test_PgqueueBasicFunctionality(BasicFunctionality):
    pass


class test_PgqueueBaseExchangeTypes(BaseExchangeTypes):
    pass


class test_PgqueueTimeToLive(BaseTimeToLive):
    pass


class test_PgqueuePriority(BasePriority):
    #: higher numbers first, as on RabbitMQ (the mixin's default)
    PRIORITY_ORDER = "asc"


class test_PgqueueFailover(BaseFailover):
    pass


class test_PgqueueMessage(BaseMessage):
    pass


class test_PgqueueEventLoop(BaseEventLoop):
    pass
