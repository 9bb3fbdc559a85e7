"""Fixtures for the transport tests that drive a real Kombu event loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from kombu.asynchronous import Hub
from waiting import WaitTimeout


class LoopHub(Hub):
    """Kombu's Hub, with a way to run it until something happened."""

    def run_until(
        self, done: Callable[[], bool], timeout: float, what: str = "the loop's condition"
    ) -> None:
        """Run the loop until ``done()``; fail the test (WaitTimeout) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"timed out after {timeout}s waiting for {what}")
            self.run_once()


@pytest.fixture
def hub() -> Iterator[LoopHub]:
    loop = LoopHub()
    yield loop
    loop.close()
