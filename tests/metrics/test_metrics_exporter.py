"""The exporter as a user runs it: ``celery -A app pgqueue metrics`` and
``python -m celery_pgqueue.metrics``, each in a subprocess, read over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from metrics_app import process_env, scrape, value

from kombu_pgqueue._store import Outgoing

HERE = Path(__file__).resolve().parent

Start = Callable[..., str]


@pytest.fixture
def start(dsn: str, tmp_path: Path) -> Iterator[Start]:
    """``start(*argv, schema=...)``: run an exporter; return its /metrics URL."""
    started: list[subprocess.Popen[str]] = []

    def start(*argv: str, schema: str) -> str:
        log_path = tmp_path / f"exporter-{len(started)}.err"
        with open(log_path, "w") as errors:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                cwd=HERE,
                env=process_env(dsn, schema),
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                start_new_session=True,
            )
        started.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:  # ends if the process exits
            found = re.search(r"on http://[^:]+:(\d+)/metrics", line)
            if found:
                return f"http://127.0.0.1:{found[1]}/metrics"
        proc.wait(timeout=10)
        log = log_path.read_text()
        pytest.fail(f"exporter exited ({proc.returncode}) without serving:\n{log[-3000:]}")

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


@pytest.fixture
def known_state(store, later) -> None:
    """'celery': 3 ready, 1 delayed; 'other': 1 dead letter."""
    for _ in range(3):
        store.publish(Outgoing(queue="celery", body=b"x", headers="{}", properties="{}"))
    store.publish(
        Outgoing(queue="celery", body=b"x", headers="{}", properties="{}", eta=later(3600))
    )
    store.publish(Outgoing(queue="other", body=b"x", headers="{}", properties="{}"))
    [held] = store.claim("other", 1, 7)
    store.bury(held.id, 7, "rejected")


def assert_known_state(url: str, schema: str) -> None:
    samples = scrape(url)
    assert value(samples, "pgqueue_up", schema=schema) == 1.0
    found = {
        (queue, state): value(samples, "pgqueue_queue_messages", queue=queue, state=state)
        for queue in ("celery", "other")
        for state in ("ready", "leased", "delayed", "dead")
    }
    assert {key: n for key, n in found.items() if n} == {
        ("celery", "ready"): 3.0,
        ("celery", "delayed"): 1.0,
        ("other", "dead"): 1.0,
    }
    assert value(samples, "pgqueue_queue_oldest_ready_age_seconds", queue="celery") >= 0
    assert value(samples, "pgqueue_queue_oldest_ready_age_seconds", queue="other") == 0
    # an exporter claims nothing: it serves no process counters
    assert not [name for name, _ in samples if name.endswith("_total")]


def test_celery_pgqueue_metrics_command(start, known_state, schema):
    url = start(
        "-m", "celery", "-A", "metrics_app", "pgqueue", "metrics", "--port", "0", schema=schema
    )

    assert_known_state(url, schema)


def test_celery_pgqueue_metrics_command_with_another_schema(start, known_state, schema):
    # the app's own schema does not exist; --schema points at the one with messages
    url = start(
        "-m",
        "celery",
        "-A",
        "metrics_app",
        "pgqueue",
        "metrics",
        "--port",
        "0",
        "--schema",
        schema,
        "--interval",
        "0",
        schema=f"{schema}_absent",
    )

    assert_known_state(url, schema)


def test_python_m_celery_pgqueue_metrics(start, known_state, schema, dsn):
    url = start(
        "-m",
        "celery_pgqueue.metrics",
        "--dsn",
        dsn,
        "--schema",
        schema,
        "--port",
        "0",
        schema=schema,
    )

    assert_known_state(url, schema)


def test_an_exporter_on_a_missing_schema_reports_down(start, schema, dsn, db):
    url = start(
        "-m",
        "celery_pgqueue.metrics",
        "--dsn",
        dsn,
        "--schema",
        schema,
        "--port",
        "0",
        schema=schema,
    )

    samples = scrape(url)

    assert value(samples, "pgqueue_up", schema=schema) == 0.0
    # a monitor never installs the schema
    row = db.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    assert row == (0,)
