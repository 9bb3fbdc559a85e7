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
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery_apps import celery_app
from celery_workers import workers
from waiting import Process, wait_for

pytestmark = pytest.mark.celery

WORKER = "pgqueue-flower@localhost"
DEADLINE = 90.0
#: the probes of a server that is still starting raise these: refused, reset, half a body
NOT_UP_YET = (OSError, ValueError)

APP_MODULE = """
import os

from celery_apps import celery_app
from celery_workers import workers

app = celery_app(
    os.environ["FLOWER_TEST_DSN"],
    os.environ["FLOWER_TEST_SCHEMA"],
    main="flowerapp",
    results=False,
    polling_interval=1.0,
    conf={"task_send_sent_event": True, "worker_hijack_root_logger": True},
)


@app.task(shared=False, name="flowerapp.add")
def add(x, y):
    return x + y


@app.task(shared=False, name="flowerapp.fail")
def fail():
    raise ValueError("boom")
"""


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
    tests = str(Path(__file__).resolve().parents[1])  # celery_apps
    env.update(
        FLOWER_TEST_DSN=dsn,
        FLOWER_TEST_SCHEMA=schema,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), tests, env.get("PYTHONPATH")])),
        # Flower 2 answers /api/* with 401 unless auth is set up or this is set
        FLOWER_UNAUTHENTICATED_API="true",
    )
    return env


@pytest.fixture
def worker(flower_env: dict[str, str], tmp_path: Path) -> Iterator[Process]:
    with workers(tmp_path) as started:
        worker = started.run(
            "worker",
            ["-A", "flowerapp", "worker", "-E", "-P", "threads", "-c", "2",
             "-n", WORKER, "--without-mingle", "--without-gossip", "-l", "info"],
            cwd=tmp_path,
            env=flower_env,
        )  # fmt: skip
        try:
            yield worker
        finally:
            stop(worker.proc)


@pytest.fixture
def flower(flower_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[str, Process]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with workers(tmp_path) as started:
        flower = started.run(
            "flower",
            ["-A", "flowerapp", "flower", f"--port={port}", "--address=127.0.0.1"],
            cwd=tmp_path,
            env=flower_env,
        )
        try:
            wait_for(
                lambda: get_status(base + "/healthcheck") == (200, "OK"),
                DEADLINE,
                "Flower to answer /healthcheck",
                flower,
                ignore=NOT_UP_YET,
            )
            yield base, flower
        finally:
            stop(flower.proc)


@pytest.fixture
def producer(dsn: str, schema: str) -> Iterator[Celery]:
    app = celery_app(
        dsn,
        schema,
        main="flower-producer",
        results=False,
        conf={"task_send_sent_event": True},
    )
    yield app
    app.close()


def test_flower_shows_the_worker_and_its_tasks(
    worker: Process, flower: tuple[str, Process], producer: Celery
) -> None:
    base, flower_process = flower
    watched = (worker, flower_process)

    # the worker, as Flower's inspect broadcast (a fanout exchange in PostgreSQL) finds it
    info = wait_for(
        lambda: inspected(base), DEADLINE, "the worker in /api/workers", *watched, ignore=NOT_UP_YET
    )
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

    tasks = wait_for(
        all_done, DEADLINE, "the finished tasks in /api/tasks", *watched, ignore=NOT_UP_YET
    )
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


def test_flower_remote_control_reaches_the_worker(
    worker: Process, flower: tuple[str, Process]
) -> None:
    base, flower_process = flower
    watched = (worker, flower_process)
    wait_for(
        lambda: inspected(base), DEADLINE, "the worker in /api/workers", *watched, ignore=NOT_UP_YET
    )

    reply = post_json(f"{base}/api/worker/queue/add-consumer/{WORKER}?queue=extra")
    assert "extra" in reply["message"]

    def consumes_extra() -> bool:
        info = inspected(base) or {}
        return "extra" in {q["name"] for q in info.get("active_queues", [])}

    wait_for(
        consumes_extra, DEADLINE, "the new queue in active_queues", *watched, ignore=NOT_UP_YET
    )


def test_flower_broker_views_say_pgqueue_is_not_supported_and_flower_lives_on(
    worker: Process, flower: tuple[str, Process]
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
