"""Fixtures for the transport tests that drive a real Kombu event loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kombu.asynchronous import Hub


class LoopHub(Hub):
    """Kombu's Hub, with a way to run it until something happened."""

    def run_until(self, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self.run_once()


@pytest.fixture
def hub() -> Iterator[LoopHub]:
    loop = LoopHub()
    yield loop
    loop.close()
