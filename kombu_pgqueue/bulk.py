"""Publishing many messages in one round trip.

.. code-block:: python

    with kombu.Connection("pgqueue://app@db/app") as conn:
        kombu_pgqueue.bulk.publish_many(conn, ({"n": i} for i in range(100_000)), "jobs")

One COPY per ``batch_size`` messages on the broker's own connections (an INSERT inside
an enlisted application transaction) and one NOTIFY per queue and batch, instead of a
round trip and a commit per message.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import Any

from kombu.connection import Connection
from kombu.serialization import dumps

from .exceptions import ConfigurationError


def publish_many(
    connection: Connection,
    bodies: Iterable[Any],
    routing_key: str,
    *,
    serializer: str = "json",
    headers: dict[str, Any] | None = None,
    priority: int = 0,
    batch_size: int = 5000,
) -> int:
    """Publish every body in ``bodies`` to queue ``routing_key``; return how many were stored."""
    channel = connection.default_channel
    if not hasattr(channel, "publish_many"):
        raise ConfigurationError(
            f"publish_many needs a pgqueue connection, not {connection.transport_cls!r}"
        )
    stored = 0
    iterator = iter(bodies)
    while batch := list(islice(iterator, batch_size)):
        messages = []
        for body in batch:
            content_type, content_encoding, payload = dumps(body, serializer=serializer)
            messages.append(
                channel.prepare_message(
                    payload, priority, content_type, content_encoding, dict(headers or {}), {}
                )
            )
        stored += channel.publish_many(messages, routing_key)
    return stored
