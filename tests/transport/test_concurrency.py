"""Competing consumers: SKIP LOCKED claims hand each message to exactly one of them."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kombu import Connection, Consumer, Queue

from kombu_pgqueue._store import Outgoing

MESSAGES = 10_000
CONSUMERS = 8


def _kombu_message(queue: str, n: int) -> Outgoing:
    # what Producer.publish would store for the body {"n": n}, in one round trip for all
    properties = {
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "priority": 0,
        "body_encoding": None,
    }
    return Outgoing(
        queue=queue,
        body=json.dumps({"n": n}).encode(),
        headers="{}",
        properties=json.dumps(properties),
        content_type="application/json",
        content_encoding="utf-8",
    )


def test_claim_by_concurrent_consumers_delivers_each_message_exactly_once(
    connection: Connection, make_connection: Callable[..., Connection]
) -> None:
    store = connection.default_channel.store
    assert store.publish_many([_kombu_message("crowd", n) for n in range(MESSAGES)]) == MESSAGES
    connections = [make_connection() for _ in range(CONSUMERS)]
    seen: list[list[int]] = [[] for _ in range(CONSUMERS)]
    errors: list[BaseException] = []
    lock = threading.Lock()
    total = [0]
    finished = threading.Event()
    start = threading.Barrier(CONSUMERS)

    def consume(index: int) -> None:
        conn = connections[index]

        def on_message(body: dict[str, Any], message: Any) -> None:
            seen[index].append(body["n"])
            message.ack()
            with lock:
                total[0] += 1
                if total[0] >= MESSAGES:
                    finished.set()

        try:
            with Consumer(conn, [Queue("crowd")], callbacks=[on_message], prefetch_count=50):
                start.wait(timeout=30)
                deadline = time.monotonic() + 90
                while not finished.is_set() and time.monotonic() < deadline:
                    try:
                        conn.drain_events(timeout=0.5)
                    except TimeoutError:
                        pass
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            finished.set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(CONSUMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert errors == []
    counts = Counter(n for per_consumer in seen for n in per_consumer)
    duplicates = {n: c for n, c in counts.items() if c > 1}
    assert duplicates == {}
    assert set(counts) == set(range(MESSAGES))
    assert sum(1 for per_consumer in seen if per_consumer) >= 2  # they really competed
    assert store.size("crowd") == 0
    assert store.dead_letters("crowd") == []
