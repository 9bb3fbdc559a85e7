"""Routing is shared: bindings declared on one connection route what another publishes."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from helpers import drain
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.exceptions import ChannelError
from kombu.transport.virtual.exchange import TopicExchange

from kombu_pgqueue import ConfigurationError


@pytest.fixture
def sender(make_connection: Callable[..., Connection]) -> Connection:
    """A second connection that never declares the exchanges it publishes to."""
    return make_connection()


def test_direct_exchange_routes_by_key_across_connections(
    connection: Connection, sender: Connection
) -> None:
    exchange = Exchange("direct-x", "direct")
    for name, key in (("red-q", "red"), ("blue-q", "blue"), ("red-q2", "red")):
        Queue(name, exchange, key)(connection.default_channel).declare()

    producer = Producer(sender)
    producer.publish("r", exchange="direct-x", routing_key="red")
    producer.publish("b", exchange="direct-x", routing_key="blue")
    producer.publish("nobody", exchange="direct-x", routing_key="green")

    assert drain(connection, "red-q") == ["r"]
    assert drain(connection, "red-q2") == ["r"]
    assert drain(connection, "blue-q") == ["b"]


@pytest.mark.parametrize(
    ("routing_key", "expected"),
    [
        ("stock.usd", {"all-stock", "usd-stock"}),
        ("stock.nyse.usd", {"all-stock"}),
        ("bond.eur", {"any-eur"}),
        ("stock.eur", {"all-stock", "any-eur"}),
        ("stockXusd", set()),
        ("bond.nyse.eur", set()),
    ],
)
def test_topic_exchange_routes_by_pattern_across_connections(
    connection: Connection, sender: Connection, routing_key: str, expected: set[str]
) -> None:
    exchange = Exchange("topic-x", "topic")
    bindings = {"all-stock": "stock.#", "any-eur": "*.eur", "usd-stock": "stock.usd"}
    for name, key in bindings.items():
        Queue(name, exchange, key)(connection.default_channel).declare()

    Producer(sender).publish(routing_key, exchange="topic-x", routing_key=routing_key)

    reached = {name for name in bindings if drain(connection, name) == [routing_key]}
    assert reached == expected


def test_topic_exchange_routes_like_kombus_own_matcher(
    connection: Connection, sender: Connection
) -> None:
    # the patterns are kombu's Python regexes, evaluated by PostgreSQL; they must agree
    bindings = {
        "t-star": "a.*",
        "t-hash-front": "#.z",
        "t-dash": "x-y.*",
        "t-unicode": "ü.#",
        "t-plus": "a+b.c",
        "t-parens": "(p).*",
        "t-two-stars": "*.*",
        "t-brackets": "[q].#",
        "t-backslash": "back\\slash.*",
        "t-dollar": "$.^",
    }
    exchange = Exchange("oracle-x", "topic")
    for name, key in bindings.items():
        Queue(name, exchange, key)(connection.default_channel).declare()
    matcher = TopicExchange(connection.default_channel)
    keys = [
        "a.b",
        "a.b.c",
        "q.z",
        "y.z",
        "x-y.1",
        "ü.é.e",
        "a+b.c",
        "aab.c",
        "(p).x",
        "p.x",
        "[q].r",
        "q.r",
        "back\\slash.1",
        "$.^",
        "a",
    ]

    for key in keys:
        Producer(sender).publish(key, exchange="oracle-x", routing_key=key)

    for name, binding in bindings.items():
        pattern = matcher.key_to_pattern(binding)
        expected = [key for key in keys if re.match(pattern, key)]
        assert drain(connection, name) == expected, (binding, pattern)


def test_fanout_exchange_reaches_every_bound_queue_across_connections(
    connection: Connection, sender: Connection, make_connection: Callable[..., Connection]
) -> None:
    exchange = Exchange("fan-x", "fanout")
    Queue("fan-1", exchange)(connection.default_channel).declare()
    third = make_connection()
    Queue("fan-2", exchange)(third.default_channel).declare()

    Producer(sender).publish({"event": "hello"}, exchange="fan-x", routing_key="ignored")

    assert drain(connection, "fan-1") == [{"event": "hello"}]
    assert drain(third, "fan-2") == [{"event": "hello"}]


def test_fanout_consumer_on_one_connection_gets_what_another_publishes(
    connection: Connection, sender: Connection
) -> None:
    exchange = Exchange("fan-live", "fanout")
    got: list[object] = []
    queue = Queue("fan-live-q", exchange)
    with Consumer(connection, [queue], callbacks=[lambda body, m: (got.append(body), m.ack())]):
        Producer(sender).publish("broadcast", exchange="fan-live")
        connection.drain_events(timeout=5)

    assert got == ["broadcast"]


def test_queue_unbind_on_one_connection_stops_routing_from_another(
    connection: Connection, sender: Connection
) -> None:
    exchange = Exchange("unbind-x", "direct")
    bound = Queue("unbind-q", exchange, "k")(connection.default_channel)
    bound.declare()
    Producer(sender).publish("before", exchange="unbind-x", routing_key="k")

    bound.unbind_from(exchange, routing_key="k")
    Producer(sender).publish("after", exchange="unbind-x", routing_key="k")

    assert drain(connection, "unbind-q") == ["before"]


def test_exchange_declare_passive_sees_an_exchange_declared_elsewhere(
    connection: Connection, sender: Connection
) -> None:
    Exchange("declared-elsewhere", "topic")(connection.default_channel).declare()

    sender.default_channel.exchange_declare("declared-elsewhere", passive=True)
    with pytest.raises(ChannelError):
        sender.default_channel.exchange_declare("never-declared", passive=True)


def test_exchange_delete_stops_routing_everywhere(
    connection: Connection, sender: Connection
) -> None:
    exchange = Exchange("deleted-x", "fanout")
    Queue("deleted-q", exchange)(connection.default_channel).declare()

    exchange(connection.default_channel).delete()
    Producer(sender).publish("lost", exchange="deleted-x")

    assert drain(connection, "deleted-q") == []


def test_exchange_declare_rejects_unsupported_types(connection: Connection) -> None:
    with pytest.raises(ConfigurationError, match="headers"):
        connection.default_channel.exchange_declare("headers-x", type="headers")
