"""The README's demo, run as a user runs it, against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.celery

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def test_demo_passes_every_check(dsn: str) -> None:
    # the demo uses the default schema 'pgqueue' of the test database
    done = subprocess.run(
        [sys.executable, str(DEMO)],
        env={**os.environ, "PGQUEUE_DSN": dsn},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "6/6 checks passed" in done.stdout, (done.stdout, done.stderr)
    assert "queue" in done.stdout.split("$ celery -A tasks pgqueue queues", 1)[1]
