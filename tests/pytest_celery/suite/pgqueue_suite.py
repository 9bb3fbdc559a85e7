"""pgqueue nodes for pytest-celery's own suite (its v1.3.0 tag's ``tests/``).

``run.py`` copies this module beside the suite, writes a root ``conftest.py`` that
loads ``celery_pgqueue.pytest_celery`` and this module's collection hook, and appends to
each of the suite's conftests (and to ``tests/smoke/test_failover.py``) an import of
the fixtures here that replace their containers, because a conftest's fixture wins over
a plugin's:

* ``default_worker_container``: the adapter's local ``celery worker`` process, built
  from the suite's own ``default_worker_*`` fixtures and vendor class (its worker name,
  queue and log level);
* ``worker_of(cls, name)``: a second worker process named by another vendor class of the
  suite (``celery_latest_worker`` in the smoke tests, ``celery4_worker`` in the
  custom-setup tests), where the suite builds another image;
* ``celery_broker_cluster`` for the failover test: a broker on a throwaway PostgreSQL
  cluster of its own, which ``kill()`` really stops, then the session's server.

``CONTAINER_ONLY`` names the tests whose subject is a container or an image and marks
them skipped with the reason; ``run.py`` prints the counts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pytest_celery import CeleryBrokerCluster, CeleryTestWorker

from celery_pgqueue.pytest_celery import (
    PgqueueServer,
    PgqueueTestBroker,
    default_worker_container,
    local_worker,
)
from kombu_pgqueue.embedded import broker_url

__all__ = [
    "CONTAINER_ONLY",
    "DIFFERENT",
    "ClusterServer",
    "celery_broker_cluster",
    "default_worker_container",
    "pytest_collection_modifyitems",
    "worker_of",
]

_VENDOR = "the {} vendor's container and client are its subject (image {})"

#: node-id fragment -> why the test needs pytest-celery's containers
CONTAINER_ONLY: dict[str, str] = {
    "tests/integration/vendors/test_rabbitmq.py": _VENDOR.format("RabbitMQ", "rabbitmq"),
    "tests/integration/vendors/test_redis.py": _VENDOR.format("Redis", "redis"),
    "tests/integration/vendors/test_memcached.py": _VENDOR.format("Memcached", "memcached"),
    "tests/integration/vendors/test_localstack.py": _VENDOR.format(
        "Localstack", "localstack/localstack"
    ),
    "test_container.py::test_celery_test_container::test_client[default_rabbitmq_broker]": (
        _VENDOR.format("RabbitMQ", "rabbitmq")
    ),
    "test_container.py::test_celery_test_container::test_ready[default_rabbitmq_broker]": (
        _VENDOR.format("RabbitMQ", "rabbitmq")
    ),
    "[default_redis_b": _VENDOR.format("Redis", "redis"),
    "[default_memcached_backend]": _VENDOR.format("Memcached", "memcached"),
    "[default_localstack_broker]": _VENDOR.format("Localstack", "localstack/localstack"),
    "test_custom_setup.py::test_custom_setup::test_custom_cluster_version": (
        "asserts the versions of two worker images built for Celery 4.4.7 and 5.2.7; a "
        "local worker is the installed Celery (pgqueue needs Celery 5.5 or later)"
    ),
    "vendors/test_worker.py::test_celery_worker_container::test_disabling_cluster": (
        "asserts the image's default broker URL (DEFAULT_WORKER_ENV, amqp://) in the "
        "worker's banner; a pgqueue worker's banner shows its pgqueue:// URL"
    ),
}


#: node-id fragment -> why the test's assertion does not hold on pgqueue nodes (run,
#: marked xfail: the suite's xfail_strict turns an unexpected pass into a failure)
DIFFERENT: dict[str, str] = {
    "test_worker_is_connected_to_backend": (
        "strips only 'cache+' from the backend URL; Celery's database backend's as_uri() "
        "drops 'db+' from db+postgresql+psycopg://"
    ),
    "test_worker_is_connected_to_broker": (
        "strips only 'guest:**@'; Kombu's as_uri() of pgqueue:// adds ':**' and the "
        "default port 5432 to the node's URL"
    ),
    "test_worker.py::test_celey_test_worker::test_version": (
        "the vendor class's version is '' (the image's newest Celery); a local worker "
        "reports the Celery it runs"
    ),
    "test_worker.py::test_celery_worker_cluster::test_versions": (
        "as test_version: the installed Celery, not the vendor class's ''"
    ),
    "tests/unit/vendors/test_worker/test_worker.py::test_celery_worker_container::"
    "test_celery_worker_container_env": (
        "asserts the default env's cache+memory:// backend; the adapter's backend node "
        "is the database backend (a memory cache cannot cross processes)"
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fragment, reason in CONTAINER_ONLY.items():
            if fragment in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"container-only: {reason}"))
                break
        else:
            for fragment, reason in DIFFERENT.items():
                if fragment in item.nodeid:
                    item.add_marker(pytest.mark.xfail(reason=f"pgqueue: {reason}"))
                    break


def worker_of(container_cls: type[Any], name: str) -> Any:
    """A fixture ``name``: a worker process named and queued as ``container_cls`` says."""

    @pytest.fixture(name=name)
    def fixture(
        request: pytest.FixtureRequest, tmp_path: Path, celery_setup_app: Any
    ) -> Iterator[CeleryTestWorker]:
        node = local_worker(request, tmp_path, container_cls)
        worker = CeleryTestWorker(node, app=celery_setup_app)
        yield worker
        worker.teardown()

    return fixture


def _clusters() -> Any:
    """The project's ``tests/clusters.py`` (``run.py`` says where it is)."""
    here = os.environ["PGQUEUE_PROJECT_TESTS"]
    if here not in sys.path:
        sys.path.append(here)
    import clusters

    return clusters


class ClusterServer(PgqueueServer):
    """A broker "container" that is a PostgreSQL cluster of its own: ``kill()`` stops it
    (``pg_ctl stop -m immediate``, a crash), ``restart()`` starts it again."""

    def __init__(self, cluster: Any, dbname: str) -> None:
        dsn = cluster.dsn_for(dbname)
        super().__init__(dsn, broker_url(dsn), "broker")
        self.cluster = cluster

    def kill(self, signal: str | int | None = "SIGKILL") -> None:
        if self.cluster.running():
            self.cluster.stop("immediate")
        self.running = False

    def restart(self, timeout: float | None = None) -> None:
        if self.cluster.running():
            self.cluster.stop("fast")
        self.cluster.start()
        self.running = True

    def teardown(self) -> None:
        self.cluster.destroy()


@pytest.fixture
def celery_broker_cluster(celery_pgqueue_broker: Any) -> Iterator[CeleryBrokerCluster]:
    """The failover test's two brokers: first a throwaway cluster (the broker the test
    kills), then the session's server (where the worker and the test's app go on)."""
    cluster = _clusters().Cluster.primary(name="failover")
    first = PgqueueTestBroker(ClusterServer(cluster, "postgres"))
    brokers = CeleryBrokerCluster(first, celery_pgqueue_broker)
    yield brokers
    brokers.teardown()
