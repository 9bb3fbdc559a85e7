"""Spark fixtures: one local SparkSession for the whole test session (the Celery
``app`` is the one of ``tests/conftest.py``).

Spark takes seconds to start, so every test shares one session. Its master is
``local[2,4]``: two cores, and up to four attempts per task (local masters ignore
``spark.task.maxFailures``), so a partition that fails is retried as on a cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping for start_worker
import pytest

HERE = Path(__file__).resolve().parent

#: PySpark 4 runs on Java 17 and later
JAVA_MIN = 17


def java_problem() -> str | None:
    """Why Spark cannot start here (no Java, or too old a one), or None.

    Found as PySpark's launcher finds it: ``$JAVA_HOME/bin/java``, else ``java`` on PATH.
    """
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home, "bin", "java")) if home else shutil.which("java")
    where = f"JAVA_HOME={home}" if home else "PATH"
    if not java or not os.access(java, os.X_OK):
        return f"no java found (on {where})"
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{java} -version failed: {exc}"
    found = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if done.returncode != 0 or not found:
        return f"{java} -version failed: {(done.stderr or done.stdout).strip()[:200]}"
    major = int(found[1]) if found[1] != "1" else int(found[2] or 0)  # "1.8" is Java 8
    if major < JAVA_MIN:
        return f"{java} is Java {major}"
    return None


class _NoJava(pytest.Item):
    """Stands for the Spark tests when Java is missing: one failure, one line."""

    def __init__(self, *, problem: str, count: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.problem, self.count = problem, count

    def runtest(self) -> None:
        raise RuntimeError(self.problem)

    def repr_failure(self, excinfo: object, style: object = None) -> str:
        return (
            f"the {self.count} Spark tests need Java {JAVA_MIN} or later: {self.problem}. "
            f"Install a JDK (Debian: apt-get install openjdk-{JAVA_MIN}-jre-headless) "
            "or set JAVA_HOME; without Spark: python -m pytest --ignore=tests/spark"
        )

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, "the Spark tests"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a usable Java every Spark test would error with the same long traceback
    of PySpark's launcher: put one failing item in their place instead (a failure, not
    a skip: CI has Java and must run them)."""
    spark = [item for item in items if HERE in item.path.parents]
    if not spark:
        return
    problem = java_problem()
    if problem is None:
        return
    config.hook.pytest_deselected(items=spark)
    stand_in = _NoJava.from_parent(
        spark[0].parent, name="needs_java", problem=problem, count=len(spark)
    )
    items[:] = [item for item in items if item not in spark] + [stand_in]


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
