"""The deliveries a consumer holds, and what each held one needs: its id and lease.

One object with a lock, shared by the thread that delivers (and acks), the lease
keeper's thread, which renews everything held, and close, which releases it. Kombu's
own QoS keeps its unacked messages in a dict that only the consuming thread may
touch; nothing here reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

from . import codec


class Sink(Protocol):
    """The consuming side of one Kombu channel, as the consumer sees it."""

    def room(self) -> int | None:
        """How many more messages the channel may hold now (None: no limit)."""

    def window(self) -> int:
        """Its prefetch window (0: none)."""

    def holding(self) -> int:
        """How many delivered messages it holds unacked."""


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}

    def hold(self, tag: str) -> None:
        message_id, lease = codec.parse_tag(tag)
        if lease:  # taken without ack: nothing to renew or settle
            with self._lock:
                self._held[tag] = (message_id, lease)

    def settle(self, tag: str) -> tuple[int, int]:
        """Stop holding ``tag``; return its (id, lease)."""
        with self._lock:
            self._held.pop(tag, None)
        return codec.parse_tag(tag)

    def settle_all(self, tags: Iterable[str]) -> list[tuple[int, int]]:
        """Stop holding ``tags``; return the (id, lease) of those with a lease."""
        settled = [self.settle(tag) for tag in tags]
        return [(message_id, lease) for message_id, lease in settled if lease]

    def held(self) -> list[tuple[int, int]]:
        """(id, lease) of everything held now (any thread)."""
        with self._lock:
            return list(self._held.values())

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
