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

import psycopg
import pytest
from helpers import open_gate
from metrics_app import Samples, create_gates, make_app, process_env, scrape, value
from waiting import Process, wait_for

import kombu_pgqueue

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent


@contextmanager
def running_worker(dsn: str, schema: str, log_path: Path) -> Iterator[Process]:
    """A prefork worker with ``--pgqueue-metrics-port 0``, stopped warmly at the end."""
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
            env=process_env(dsn, schema),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield Process("worker", proc, log_path)
        proc.send_signal(signal.SIGTERM)  # warm shutdown: the step stops its server
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
    finally:
        try:  # the group outlives its leader while orphaned pool children run
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture
def worker(dsn: str, schema: str, db: psycopg.Connection, tmp_path: Path) -> Iterator[Process]:
    kombu_pgqueue.migrate(dsn, schema)
    create_gates(db, schema)
    with running_worker(dsn, schema, tmp_path / "worker.log") as worker:
        yield worker


def served_port(worker: Process) -> int:
    def found() -> int | None:
        match = re.search(r"pgqueue metrics on http://[^:]+:(\d+)/metrics", worker.log())
        return int(match[1]) if match else None

    return int(wait_for(found, 60, "the worker's metrics server", worker))


def test_worker_serves_its_counters_and_the_queue_gauges(worker, dsn, schema, db):
    app = make_app(dsn, schema)
    try:
        app.send_task("metrics.hold", ("held",))  # held until its lease was renewed
        for _ in range(3):
            app.send_task("metrics.hold")
    finally:
        app.close()
    url = f"http://127.0.0.1:{served_port(worker)}/metrics"

    try:
        wait_for(
            lambda: (value(scrape(url), "pgqueue_lease_renewals_total") or 0) >= 1,
            60,
            "the held task's lease renewed (every 0.2 s), seen through the metrics",
            worker,
        )
    finally:
        open_gate(db, schema, "held")  # and the worker can stop warmly, whatever happened

    def all_done() -> Samples | None:
        samples = scrape(url)
        done = (
            value(samples, "pgqueue_claimed_total", queue="celery") == 4
            and value(samples, "pgqueue_acked_total") == 4
            and value(samples, "pgqueue_queue_messages", queue="celery", state="ready") == 0
            and value(samples, "pgqueue_queue_messages", queue="celery", state="leased") == 0
        )
        return samples if done else None

    samples = wait_for(all_done, 60, "4 tasks claimed and acked, seen through the metrics", worker)

    assert value(samples, "pgqueue_lease_renewals_total") >= 1
    assert value(samples, "pgqueue_redelivered_total", queue="celery") == 0
    assert value(samples, "pgqueue_rejected_total") == 0
    assert value(samples, "pgqueue_up", schema=schema) == 1.0
    assert value(samples, "pgqueue_queue_oldest_ready_age_seconds", queue="celery") == 0


def test_a_running_task_acked_early_is_counted_by_its_worker(worker, dsn, schema, db):
    """The queue's "leased" counts messages held by a lease; a task acked as it starts
    has no message left, so only the worker can count it."""
    app = make_app(dsn, schema)
    try:
        app.send_task("metrics.hold_early", ("early",))
    finally:
        app.close()
    url = f"http://127.0.0.1:{served_port(worker)}/metrics"

    def running(count: int) -> bool:
        return value(scrape(url), "pgqueue_worker_tasks_running") == count

    def gone() -> bool:
        samples = scrape(url)
        return all(
            value(samples, "pgqueue_queue_messages", queue="celery", state=state) == 0
            for state in ("ready", "leased")
        )

    try:
        wait_for(lambda: running(1), 60, "the task running, seen", worker)
        wait_for(gone, 60, "its message acked: neither ready nor leased", worker)
        assert running(1)
    finally:
        open_gate(db, schema, "early")
    wait_for(lambda: running(0), 60, "the task done, seen", worker)
