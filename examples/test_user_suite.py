"""A user's own test suite on a throwaway pgqueue broker (see docs/testing.md).

Run it with ``python -m pytest examples/test_user_suite.py``: with no DSN it starts an
embedded PostgreSQL; ``--pgqueue-dsn DSN`` or ``PGQUEUE_TEST_DSN`` use a server of
yours. Each test gets a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import pytest

# Celery's fixtures (celery_app, celery_worker, ...). In a real project this line goes
# in the root conftest.py. Do not use pytest-celery 1.x for this: it replaces
# celery_worker with a Docker-based fixture.
pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture
def celery_config(pgqueue_celery_config):
    # pgqueue's broker and result backend, on this test's schema
    return pgqueue_celery_config


def test_worker_runs_a_task_through_pgqueue(celery_app, celery_worker):
    @celery_app.task(shared=False)
    def add(x, y):
        return x + y

    # the worker was started before the task existed: reload its task registry
    celery_worker.reload()
    assert add.delay(2, 3).get(timeout=30) == 5


def test_each_test_has_a_schema_of_its_own(celery_app, pgqueue_schema):
    options = celery_app.conf.broker_transport_options
    assert options["schema"] == pgqueue_schema
    assert celery_app.conf.broker_url.startswith("pgqueue")


def test_plain_kombu_on_the_test_schema(pgqueue_broker_url, pgqueue_transport_options):
    from kombu import Connection

    with Connection(pgqueue_broker_url, transport_options=pgqueue_transport_options) as conn:
        queue = conn.SimpleQueue("jobs")
        queue.put({"id": 1})
        message = queue.get(timeout=10)
        message.ack()
        assert message.payload == {"id": 1}
        queue.close()
