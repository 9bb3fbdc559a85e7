"""Spark fixtures: one local SparkSession for the whole test session, and a Celery app.

Spark takes seconds to start, so every test shares one session. Its master is
``local[2,4]``: two cores, and up to four attempts per task (local masters ignore
``spark.task.maxFailures``), so a partition that fails is retried as on a cluster.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping for start_worker
import pytest
from celery import Celery

import celery_pgqueue


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    # the executors' Python must be this one, with this package installed
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2,4]")
        .appName("pgqueue-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(params=["arrow", "rows"])
def transfer(request: pytest.FixtureRequest) -> str:
    """How rows reach Python: Arrow batches, or pickled rows (without pyarrow/pandas)."""
    return str(request.param)


@pytest.fixture
def celery_dsn(dsn: str) -> str:
    return dsn or "postgresql://"


@pytest.fixture
def app(celery_dsn: str, schema: str) -> Iterator[Celery]:
    app = Celery(f"spark_{schema}", set_as_current=False)
    celery_pgqueue.configure(
        app, celery_dsn, schema=schema, polling_interval=0.5, visibility_timeout=10
    )
    app.conf.update(
        task_default_queue="celery",
        worker_hijack_root_logger=False,
        result_backend_always_retry=False,
        database_short_lived_sessions=True,
    )
    yield app
    app.close()
