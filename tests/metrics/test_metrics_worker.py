"""The worker bootstep: a real ``celery worker`` (prefork) serves its own counters and the
queue gauges on ``--pgqueue-metrics-port``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from metrics_app import Samples, make_app, scrape, value, wait_for

import kombu_pgqueue

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent


@contextmanager
def running_worker(celery_dsn: str, schema: str, log_path: Path) -> Iterator[Path]:
    """A prefork worker with ``--pgqueue-metrics-port 0``, stopped warmly at the end."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "PGQUEUE_DSN": celery_dsn,
        "PGQUEUE_SCHEMA": schema,
    }
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "metrics_app",
                "worker",
                "-n",
                "metrics@%h",
                "-P",
                "prefork",
                "-c",
                "1",
                "-l",
                "info",
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                "--pgqueue-metrics-port",
                "0",
            ],
            cwd=HERE,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield log_path
        proc.send_signal(signal.SIGTERM)  # warm shutdown: the step stops its server
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        try:  # the group outlives its leader while orphaned pool children run
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture
def worker_log(celery_dsn: str, schema: str, tmp_path: Path) -> Iterator[Path]:
    kombu_pgqueue.migrate(celery_dsn, schema)
    with running_worker(celery_dsn, schema, tmp_path / "worker.log") as log_path:
        yield log_path


def served_port(log_path: Path) -> int:
    def found() -> int | None:
        match = re.search(r"pgqueue metrics on http://[^:]+:(\d+)/metrics", log_path.read_text())
        return int(match[1]) if match else None

    return int(wait_for(found, 60, "the worker's metrics server"))


def test_worker_serves_its_counters_and_the_queue_gauges(worker_log, celery_dsn, schema):
    app = make_app(celery_dsn, schema)
    try:
        app.send_task("metrics.pause", (1.0,))  # held across several renewals (every 0.2 s)
        for _ in range(3):
            app.send_task("metrics.pause", (0.0,))
    finally:
        app.close()
    url = f"http://127.0.0.1:{served_port(worker_log)}/metrics"

    def all_done() -> Samples | None:
        samples = scrape(url)
        done = (
            value(samples, "pgqueue_claimed_total", queue="celery") == 4
            and value(samples, "pgqueue_acked_total") == 4
            and value(samples, "pgqueue_queue_messages", queue="celery", state="ready") == 0
            and value(samples, "pgqueue_queue_messages", queue="celery", state="leased") == 0
        )
        return samples if done else None

    samples = wait_for(all_done, 60, "4 tasks claimed and acked, seen through the metrics")

    assert value(samples, "pgqueue_lease_renewals_total") >= 1
    assert value(samples, "pgqueue_redelivered_total", queue="celery") == 0
    assert value(samples, "pgqueue_rejected_total") == 0
    assert value(samples, "pgqueue_up", schema=schema) == 1.0
    assert value(samples, "pgqueue_queue_oldest_ready_age_seconds", queue="celery") == 0
