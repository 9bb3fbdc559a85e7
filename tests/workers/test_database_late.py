"""A worker started before its database waits for it, results configured or not, as
it waits for its broker (in docker-compose or Kubernetes the database often comes
up last), then runs tasks with no restart.

Celery's database result backend connects as it is made, and a worker makes it while
it prints its banner: with ``configure()``'s results (the default) a worker started
against a closed port exited after three retries ("Unrecoverable error:
OperationalError ... Connection refused") while one with ``results=False`` waited.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from celery_workers import workers
from clusters import Cluster
from lifecycle_app import worker_env
from results_app import make_app
from waiting import wait_for

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent


@pytest.fixture
def stopped() -> Iterator[Cluster]:
    """A throwaway cluster, stopped: its port is closed until the test starts it."""
    with Cluster.primary(name="late") as cluster:
        cluster.stop()
        yield cluster


@pytest.mark.parametrize("tables", ["public", "by-hand"])
def test_a_worker_started_before_its_database_waits_and_runs_tasks(
    stopped: Cluster, tmp_path: Path, tables: str
) -> None:
    """``configure()``'s results, and a database result backend set by hand."""
    dsn, schema = stopped.dsn, "late"
    with workers(tmp_path) as started:
        worker = started.start(
            "results_app",
            "late",
            cwd=HERE,
            env={**worker_env(dsn, schema), "PGQUEUE_RESULT_TABLES": tables},
            options=("-P", "prefork", "-c", "1", "-Q", "celery"),
        )
        wait_for(lambda: worker.says("Trying again in"), 60, "the worker to wait", worker)
        # its sweep of old results and failed tasks failed too: tried again soon, not an
        # hour (pgqueue_sweep_interval) after the database is back (a newcomer's trial)
        wait_for(lambda: worker.says("sweep failed"), 60, "the sweep to fail", worker)
        assert "sweep failed, will try again in 30s" in worker.log()

        stopped.start()
        wait_for(lambda: worker.says(" ready."), 120, "the worker to start", worker)
        app = make_app(dsn, schema, tables="public")
        try:
            assert app.send_task("results.add", (2, 3)).get(timeout=30) == 5
        finally:
            app.close()
        assert "Unrecoverable error" not in worker.log()


def test_a_first_publish_before_the_database_follows_its_retry_policy(stopped: Cluster) -> None:
    """A web process's first delay(): the result backend is made before the publish,
    and its tables were created then, so the call failed before its retry policy began."""
    dsn, schema = stopped.dsn, "late"
    app = make_app(dsn, schema, tables="public")
    retrying = threading.Event()
    policy = {
        "max_retries": None,
        "interval_start": 0.2,
        "interval_step": 0.2,
        "interval_max": 0.5,
        "errback": lambda exc, interval: retrying.set(),
    }
    try:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(app.send_task, "results.add", (2, 3), retry_policy=policy)
            wait_for(lambda: retrying.is_set() or sent.done(), 60, "the publish to retry")
            assert not sent.done(), sent.exception()
            stopped.start()
            result = sent.result(timeout=60)
        assert result.state == "PENDING"  # read from the result tables, made on first use
    finally:
        app.close()
    with stopped.connect() as conn:
        count = "SELECT count(*) FROM {}.message_store"
        assert conn.execute(count.format(schema)).fetchone() == (1,)
