"""pytest-celery's container mode on pgqueue: a PostgreSQL container is the broker and
the result backend, the worker is pytest-celery's worker container on an image with
kombu-pgqueue installed. Build the images first with ``build.sh`` (beside this file).

Do not load ``celery_pgqueue.pytest_celery`` here: its nodes are local processes, these
are containers. This conftest only replaces pytest-celery's RabbitMQ/Redis defaults.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pytest_celery import (
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryTestBackend,
    CeleryTestBroker,
    CeleryTestContainer,
)
from pytest_docker_tools import container, image

import kombu_pgqueue  # noqa: F401 - registers pgqueue:// in the test process

POSTGRES_IMAGE = "pgqueue/postgres:15"
WORKER_IMAGE = "pgqueue/celery-worker:latest"


class PgqueueContainer(CeleryTestContainer):  # type: ignore[misc]  # untyped
    """A PostgreSQL container on the test's network.

    ``url`` is what the worker container uses (the server's name on the network);
    ``host_url`` is what the test process uses, from pytest-docker-tools' ``get_addr``:
    the published port on 127.0.0.1, or the container's own address when the tests
    themselves run in a container (``/.dockerenv``), never a guessed ``localhost``.
    """

    scheme = "pgqueue"

    @property
    def client(self) -> Any:
        return None

    @property
    def celeryconfig(self) -> dict[str, str]:
        return {"url": self.url, "host_url": self.host_url}

    @property
    def url(self) -> str:
        return f"{self.scheme}://postgres@{self.attrs['Config']['Hostname']}:5432/postgres"

    @property
    def host_url(self) -> str:
        host, port = self.get_addr("5432/tcp")
        return f"{self.scheme}://postgres@{host}:{port}/postgres"

    @property
    def ready_prompt(self) -> str:
        return "database system is ready to accept connections"


class PgqueueResultsContainer(PgqueueContainer):
    """The same server, as Celery's database result backend sees it."""

    scheme = "db+postgresql+psycopg"


pgqueue_postgres_image = image(name=POSTGRES_IMAGE)

pgqueue_broker_container = container(
    image="{pgqueue_postgres_image.id}",
    ports={"5432/tcp": None},
    network="{default_pytest_celery_network.name}",
    wrapper_class=PgqueueContainer,
    timeout=60,
)

pgqueue_backend_container = container(
    image="{pgqueue_postgres_image.id}",
    ports={"5432/tcp": None},
    network="{default_pytest_celery_network.name}",
    wrapper_class=PgqueueResultsContainer,
    timeout=60,
)

# pytest-celery's worker container, on the image with kombu-pgqueue (no build here)
celery_base_worker_image = image(name=WORKER_IMAGE)


@pytest.fixture
def celery_broker_cluster(pgqueue_broker_container: PgqueueContainer) -> Iterator[Any]:
    cluster = CeleryBrokerCluster(CeleryTestBroker(pgqueue_broker_container))
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(pgqueue_backend_container: PgqueueContainer) -> Iterator[Any]:
    cluster = CeleryBackendCluster(CeleryTestBackend(pgqueue_backend_container))
    yield cluster
    cluster.teardown()


@pytest.fixture
def default_worker_app(default_worker_app: Any) -> Any:
    # the result tables, made once before the worker starts: the test's first result and
    # the worker's would otherwise race to create them
    default_worker_app.backend.ResultSession().close()
    return default_worker_app
