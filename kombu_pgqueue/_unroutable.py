"""Messages no binding matched: dropped as RabbitMQ drops them, but never silently."""

from __future__ import annotations

import logging
from typing import Any

from . import _counters
from .exceptions import MessageError

logger = logging.getLogger(__name__)

#: (exchange, routing key) pairs logged per process, at most
MAX_LOGGED = 1000


class Unroutable:
    """One transport's unroutable publishes: counted, a persistent one logged once per
    exchange and key (``mode="warn"``) or raised (``mode="raise"``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._logged: set[tuple[str, str]] = set()

    def report(self, exchange: str, routing_key: str, message: dict[str, Any]) -> None:
        if message.get("properties", {}).get("delivery_mode") == 1:
            # transient (Celery's events with no monitor bound): expected to vanish, and
            # counted apart, so that an alert on 'unroutable' means a lost message
            _counters.add("unroutable_transient")
            return
        _counters.add("unroutable")
        where = f"exchange {exchange!r} with routing key {routing_key!r}"
        if self.mode == "raise":
            raise MessageError(
                f"unroutable: no queue is bound to {where}; declare the queue and its binding "
                "first (or set transport option unroutable='warn' to drop such messages)"
            )
        key = (exchange, routing_key)
        if key not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add(key)
            logger.warning(
                "pgqueue: dropped an unroutable message: no queue is bound to %s "
                "(logged once per exchange and key; counted as 'unroutable')",
                where,
            )
