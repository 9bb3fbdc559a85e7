"""Spark fixtures: one local SparkSession for the whole test session (the Celery
``app`` is the one of ``tests/conftest.py``).

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
