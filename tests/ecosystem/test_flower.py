"""Flower on a pgqueue broker: a real worker with events (``-E``) and a real Flower,
each in a process of its own, on the test's schema; Flower's HTTP API is read as a
dashboard or a script would read it. See docs/flower.md.
"""

from __future__ import annotations

import html
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from celery import Celery

import celery_pgqueue

pytestmark = pytest.mark.celery

T = TypeVar("T")

WORKER = "pgqueue-flower@localhost"
DEADLINE = 90.0
# never set: waiting on it paces the polls without sleeping
_pause = threading.Event()

APP_MODULE = """
import os

from celery import Celery

import celery_pgqueue

app = Celery("flowerapp")
celery_pgqueue.configure(
    app,
    os.environ["FLOWER_TEST_DSN"],
    results=False,
    schema=os.environ["FLOWER_TEST_SCHEMA"],
    polling_interval=1.0,
)
app.conf.task_send_sent_event = True


@app.task(shared=False, name="flowerapp.add")
def add(x, y):
    return x + y


@app.task(shared=False, name="flowerapp.fail")
def fail():
    raise ValueError("boom")
"""


def wait_for(what: str, probe: Callable[[], T | None], logs: list[Path]) -> T:
    """Call ``probe`` until it returns something truthy; fail with the logs at the deadline."""
    deadline = time.monotonic() + DEADLINE
    last: object = None
    while time.monotonic() < deadline:
        try:
            found = probe()
        except (OSError, ValueError) as exc:  # not up yet: refused, reset, half a body
            found, last = None, exc
        if found:
            return found
        _pause.wait(0.25)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    pytest.fail(f"no {what} within {DEADLINE:.0f} s (last error: {last!r})\n{tails}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def inspected(base: str) -> dict[str, Any] | None:
    """Our worker's entry in /api/workers once every inspect reply is in (each has 1 s)."""
    info = get_json(base + "/api/workers?refresh=1").get(WORKER)
    if info and {"stats", "registered", "active_queues"} <= set(info):
        return dict(info)
    return None


def post_json(url: str) -> Any:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def get_status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def flower_env(dsn: str, schema: str, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "flowerapp.py").write_text(textwrap.dedent(APP_MODULE))
    env = dict(os.environ)
    env.update(
        FLOWER_TEST_DSN=dsn or "postgresql://",
        FLOWER_TEST_SCHEMA=schema,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
        # Flower 2 answers /api/* with 401 unless auth is set up or this is set
        FLOWER_UNAUTHENTICATED_API="true",
    )
    return env


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=log.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture
def worker(flower_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "worker.log"
    proc = spawn(
        ["celery", "-A", "flowerapp", "worker", "-E", "-P", "threads", "-c", "2",
         "-n", WORKER, "--without-mingle", "--without-gossip", "-l", "info"],
        flower_env,
        log,
    )  # fmt: skip
    try:
        yield log
    finally:
        stop(proc)


@pytest.fixture
def flower(flower_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "flower.log"
    port = free_port()
    proc = spawn(
        ["celery", "-A", "flowerapp", "flower", f"--port={port}", "--address=127.0.0.1"],
        flower_env,
        log,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("Flower", lambda: get_status(base + "/healthcheck") == (200, "OK"), [log])
        yield base, log
    finally:
        stop(proc)


@pytest.fixture
def producer(flower_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery("flower-producer", set_as_current=False)
    celery_pgqueue.configure(
        app,
        flower_env["FLOWER_TEST_DSN"],
        results=False,
        schema=flower_env["FLOWER_TEST_SCHEMA"],
    )
    app.conf.task_send_sent_event = True
    yield app
    app.close()


def test_flower_shows_the_worker_and_its_tasks(
    worker: Path, flower: tuple[str, Path], producer: Celery
) -> None:
    base, flower_log = flower
    logs = [worker, flower_log]

    # the worker, as Flower's inspect broadcast (a fanout exchange in PostgreSQL) finds it
    info = wait_for("worker in /api/workers", lambda: inspected(base), logs)
    assert {"flowerapp.add", "flowerapp.fail"} <= set(info["registered"])
    assert [q["name"] for q in info["active_queues"]] == ["celery"]
    assert info["stats"]["broker"]["transport"] == "pgqueue"

    adds = {producer.send_task("flowerapp.add", (i, i)).id: i + i for i in range(5)}
    failed = producer.send_task("flowerapp.fail").id

    # the tasks, as the worker's events (-E) told Flower
    def all_done() -> dict[str, Any] | None:
        tasks = get_json(base + "/api/tasks")
        ready = {
            uuid: task
            for uuid, task in tasks.items()
            if task.get("state") in ("SUCCESS", "FAILURE")
        }
        return tasks if set(adds) | {failed} <= set(ready) else None

    tasks = wait_for("finished tasks in /api/tasks", all_done, logs)
    for uuid, total in adds.items():
        task = tasks[uuid]
        assert (task["name"], task["state"], task["worker"]) == ("flowerapp.add", "SUCCESS", WORKER)
        assert task["result"] == str(total)
        assert task["received"] and task["started"] and task["succeeded"]
    assert tasks[failed]["state"] == "FAILURE"
    assert "boom" in tasks[failed]["exception"]

    one = get_json(f"{base}/api/task/info/{next(iter(adds))}")
    assert one["state"] == "SUCCESS"

    status = get_json(base + "/api/workers?status=1")
    assert status[WORKER] is True

    # Flower's Prometheus endpoint, fed by the same events
    code, metrics = get_status(base + "/metrics")
    assert code == 200
    assert 'flower_events_total{task="flowerapp.add",type="task-succeeded"' in metrics


def test_flower_remote_control_reaches_the_worker(worker: Path, flower: tuple[str, Path]) -> None:
    base, flower_log = flower
    logs = [worker, flower_log]
    wait_for("worker in /api/workers", lambda: inspected(base), logs)

    reply = post_json(f"{base}/api/worker/queue/add-consumer/{WORKER}?queue=extra")
    assert "extra" in reply["message"]

    def consumes_extra() -> bool:
        info = inspected(base) or {}
        return "extra" in {q["name"] for q in info.get("active_queues", [])}

    wait_for("the new queue in active_queues", consumes_extra, logs)


def test_flower_broker_views_say_pgqueue_is_not_supported_and_flower_lives_on(
    worker: Path, flower: tuple[str, Path]
) -> None:
    base, _ = flower
    # Flower knows queue lengths of RabbitMQ and Redis only; for any other transport
    # it answers 404 (pgqueue's own: `celery pgqueue queues`, docs/monitoring.md)
    code, body = get_status(base + "/api/queues/length")
    assert code == 404
    assert "'pgqueue' broker is not supported" in body
    code, body = get_status(base + "/broker")  # the Broker tab: an HTML page saying so
    assert code == 404
    assert "'pgqueue' broker is not supported" in html.unescape(body)
    # the rest of Flower is unharmed
    assert get_status(base + "/healthcheck") == (200, "OK")
    code, _ = get_status(base + "/workers")
    assert code == 200
