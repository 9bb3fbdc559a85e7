"""pytest-celery 1.3 on pgqueue (``celery_pgqueue.pytest_celery``), as its users meet it.

Each test writes a pytest-celery user's conftest and tests and runs them with pytest in
a subprocess (``pytester``), where pytest-celery loads by its entry point and the
adapter by ``pytest_plugins``, as in a user's project. The inner runs get this
session's server with ``--pgqueue-dsn``. No Docker engine is needed or contacted: a
test that reached one would error with ``DockerException``.
"""

from __future__ import annotations

import os

import pytest
from inner_pytest import TESTING_DOCS, lay_out, recipe_files, run

if not os.environ.get("CI"):
    pytest.importorskip("pytest_celery", reason="pip install '.[pytest-celery]'")

pytest_plugins = ("pytester",)


CONFTEST = """
import pytest

pytest_plugins = ("celery_pgqueue.pytest_celery",)


@pytest.fixture
def pgqueue_transport_options(pgqueue_transport_options):
    # a killed worker's lease runs out in 3 s
    return {**pgqueue_transport_options, "visibility_timeout": 3}


@pytest.fixture
def celery_setup_config(celery_setup_config):
    # a task is acknowledged when it has run, so a killed worker's task is delivered again
    return {**celery_setup_config, "task_acks_late": True}
"""

USER_TESTS = """
from celery import chain, chord, group
from pytest_celery import RESULT_TIMEOUT, CeleryTestSetup, add, identity, sleep, xsum


def test_ping(celery_setup: CeleryTestSetup):
    assert celery_setup.ready(ping=True, control=True)
    assert celery_setup.app.conf.broker_url.startswith("pgqueue://")
    assert celery_setup.app.conf.result_backend.startswith("db+postgresql+psycopg://")


def test_tasks_and_canvas(celery_setup):
    queue = celery_setup.worker.worker_queue
    assert add.s(2, 3).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT) == 5
    flow = chain(add.si(1, 2), add.s(3)).set(queue=queue)
    assert flow.apply_async().get(timeout=RESULT_TIMEOUT) == 6
    fanned = group(identity.si(i) for i in range(4)).set(queue=queue)
    assert fanned.apply_async().get(timeout=RESULT_TIMEOUT) == [0, 1, 2, 3]
    joined = chord((identity.si(i).set(queue=queue) for i in range(3)), xsum.s().set(queue=queue))
    assert joined.apply_async().get(timeout=RESULT_TIMEOUT) == 3


def test_the_worker_is_a_process_named_as_its_node(celery_setup):
    worker = celery_setup.worker
    replies = celery_setup.app.control.ping(destination=[worker.hostname()], timeout=10)
    assert replies == [{worker.hostname(): {"ok": "pong"}}]
    worker.wait_for_log("ready.")
    worker.assert_log_exists(worker.worker_name)


def test_a_killed_worker_task_is_delivered_again_after_its_lease(celery_setup):
    worker = celery_setup.worker
    result = sleep.s(2).apply_async(queue=worker.worker_queue)
    worker.wait_for_log(f"{result.id}] received")
    worker.kill()
    assert worker.container.status == "exited"
    worker.restart()
    assert result.get(timeout=RESULT_TIMEOUT) is True
    assert worker.logs().count(f"{result.id}] received") == 2
"""

CLUSTERS = """
import os

import pytest
from pytest_celery import (
    RESULT_TIMEOUT,
    CeleryBrokerCluster,
    CeleryWorkerCluster,
    identity,
)


@pytest.fixture
def celery_broker_cluster(celery_pgqueue_broker, second_broker):
    return CeleryBrokerCluster(celery_pgqueue_broker, second_broker)


@pytest.fixture
def second_broker(pgqueue_dsn):
    from celery_pgqueue.pytest_celery import PgqueueServer, PgqueueTestBroker
    from kombu_pgqueue.embedded import broker_url
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    # the same server by another address string, as a failover list holds two; its port
    # written out as the first URL's is (pgqueue refuses a list that mixes them)
    port = conninfo_to_dict(pgqueue_dsn).get("port") or os.environ.get("PGPORT") or "5432"
    dsn = make_conninfo(pgqueue_dsn, application_name="second", port=str(port))
    return PgqueueTestBroker(PgqueueServer(dsn, broker_url(dsn), "broker"))


@pytest.fixture
def celery_worker_cluster(celery_setup_worker, celery_pgqueue_worker):
    return CeleryWorkerCluster(celery_setup_worker, celery_pgqueue_worker)


def test_two_brokers_are_the_failover_list_and_two_workers_share_the_queue(celery_setup):
    assert len(celery_setup.broker_cluster) == 2
    assert celery_setup.app.conf.broker_url.count(";") == 1
    assert celery_setup.ready(ping=True)
    first, second = celery_setup.worker_cluster
    assert first.worker_queue == second.worker_queue
    assert first.hostname() != second.hostname()
    results = [identity.s(i).apply_async(queue=first.worker_queue) for i in range(20)]
    assert [r.get(timeout=RESULT_TIMEOUT) for r in results] == list(range(20))
"""


def test_a_users_pytest_celery_tests_run_on_pgqueue(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=USER_TESTS)
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=4)


def test_clusters_of_two_brokers_and_two_workers(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_clusters=CLUSTERS)
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=1)


def test_a_broker_of_another_transport_fails_at_setup_in_one_line(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makeconftest(
        CONFTEST
        + """

@pytest.fixture
def celery_broker_cluster_config():
    return {"urls": ["redis://localhost:6379/0"], "host_urls": ["redis://localhost:6379/0"]}
"""
    )
    pytester.makepyfile("def test_setup(celery_setup):\n    pass\n")
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*'redis://localhost:6379/0', not a pgqueue node*"])
    assert "DockerException" not in result.stdout.str()


def test_a_pgqueue_url_without_the_adapter_fails_at_setup_in_one_line(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makeconftest(
        """
import pytest


@pytest.fixture
def celery_broker_cluster_config(pgqueue_broker_url):
    return {"urls": [pgqueue_broker_url], "host_urls": [pgqueue_broker_url]}


@pytest.fixture
def celery_backend_cluster():
    return None  # (pytest-celery's backends are all Redis or Memcached containers)
"""
    )
    pytester.makepyfile("def test_setup(celery_setup):\n    pass\n")
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    # one setup per broker vendor pytest-celery parametrizes with (Redis and RabbitMQ
    # where their client packages are installed): each fails at setup, none runs
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors", 0) >= 1 and not outcomes.get("passed")
    assert not outcomes.get("failed")
    result.stdout.fnmatch_lines(['*pytest_plugins = ("celery_pgqueue.pytest_celery",)*'])
    assert "DockerException" not in result.stdout.str()


def test_the_testing_docs_pytest_celery_recipe_runs_verbatim(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    files = recipe_files(TESTING_DOCS.read_text(), "With pytest-celery")
    assert {"conftest.py", "test_tasks.py"} <= set(files)
    lay_out(pytester, files)
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and set(outcomes) <= {"passed"}, result.stdout.str()
