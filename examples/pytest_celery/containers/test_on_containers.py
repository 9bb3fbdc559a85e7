"""A pytest-celery user's tests, unchanged, on pgqueue containers (see conftest.py)."""

from __future__ import annotations

from celery import chain, group
from pytest_celery import RESULT_TIMEOUT, CeleryTestSetup, add, identity


def test_ping_and_canvas(celery_setup: CeleryTestSetup) -> None:
    assert celery_setup.ready(ping=True, control=True)
    assert celery_setup.app.conf.broker_url.startswith("pgqueue://")
    queue = celery_setup.worker.worker_queue
    assert add.s(2, 3).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT) == 5
    flow = chain(add.si(1, 2), add.s(3)).set(queue=queue)
    assert flow.apply_async().get(timeout=RESULT_TIMEOUT) == 6
    fanned = group(identity.si(i) for i in range(3)).set(queue=queue)
    assert fanned.apply_async().get(timeout=RESULT_TIMEOUT) == [0, 1, 2]


def test_the_worker_is_a_container_on_pgqueue(celery_setup: CeleryTestSetup) -> None:
    worker = celery_setup.worker
    worker.assert_log_exists("transport:   pgqueue://")
    assert worker.container.status == "running"
    assert worker.container.attrs["Config"]["Image"].startswith("sha256:")
