"""Results expire without ``celery beat`` (issue 32, item 5).

``configure()`` puts results in Celery's database backend, which leaves deleting them to
beat's ``celery.backend_cleanup``: without beat, ``celery_taskmeta`` only grew, where
Redis expired results by TTL. A worker on pgqueue deletes the results older than
``result_expires`` in its sweep. The result tables are in the test's schema
(``results_app``), so no other test's results are touched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from psycopg import sql
from results_app import make_app
from waiting import wait_for

from celery_pgqueue._worker import expire_results, kept

pytestmark = pytest.mark.celery


@pytest.fixture
def results(dsn: str, schema: str) -> Iterator[Celery]:
    app = make_app(dsn, schema)
    yield app
    app.close()


def _stored(app: Celery) -> str:
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, 42, "SUCCESS")
    return task_id


def _age(db: psycopg.Connection, schema: str, task_id: str, days: int) -> None:
    db.execute(
        sql.SQL(
            "UPDATE {} SET date_done = date_done - make_interval(days => %s) WHERE task_id = %s"
        ).format(sql.Identifier(schema, "celery_taskmeta")),
        (days, task_id),
    )


def _ids(db: psycopg.Connection, schema: str) -> set[str]:
    query = sql.SQL("SELECT task_id FROM {}").format(sql.Identifier(schema, "celery_taskmeta"))
    return {task_id for (task_id,) in db.execute(query)}


def test_expire_results_deletes_what_is_older_than_result_expires(
    results: Celery, db: psycopg.Connection, schema: str, later
) -> None:
    old, fresh = _stored(results), _stored(results)
    _age(db, schema, old, 2)  # result_expires: Celery's default, one day

    assert expire_results(results) == 1
    assert _ids(db, schema) == {fresh}
    results.conf.result_expires = None
    results.backend.expires = None  # as a backend made with that setting has it
    assert expire_results(results, now=later(30 * 86400)) == 0
    results.backend.expires = timedelta(hours=1)
    assert expire_results(results, now=later(2 * 3600)) == 1
    assert _ids(db, schema) == set()


def test_a_worker_expires_results_without_beat(
    results: Celery, db: psycopg.Connection, schema: str
) -> None:
    old, fresh = _stored(results), _stored(results)
    _age(db, schema, old, 2)
    results.conf.pgqueue_sweep_interval = 0.1
    assert kept(results).endswith("; results expire after 1 day (result_expires)")

    with start_worker(results, pool="threads", concurrency=1, perform_ping_check=False):
        wait_for(lambda: old not in _ids(db, schema), 60, "the old result to expire")
    assert fresh in _ids(db, schema)
    assert "pgqueue-sweep" not in [t.name for t in threading.enumerate()]  # stopped with it


#: a worker's steps in the order it starts them, printed by a process of its own (the
#: order of steps that do not depend on each other follows the hash seed)
_BOOT_ORDER = """
import sys
from celery_apps import celery_app
app = celery_app(sys.argv[1], sys.argv[2])
worker = app.WorkController(pool_cls="prefork", concurrency=1)
print([getattr(s, "label", None) or type(s).__name__ for s in worker.blueprint.order])
"""


def test_the_sweep_starts_after_the_pool_has_forked_its_children(dsn: str, schema: str) -> None:
    """The sweep's thread imports as its first sweep runs (the result backend's SQLAlchemy
    dialect). A prefork child forked meanwhile inherits that import's lock, held by a
    thread it does not have, and hangs at its first result: seen in tests/atomic, one run
    in about forty. Whatever the hash seed, the pool starts first."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    for seed in range(6):
        done = subprocess.run(
            [sys.executable, "-c", _BOOT_ORDER, dsn, schema],
            env={**env, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        order = done.stdout.strip().splitlines()[-1]
        assert order.index("'Pool'") < order.index("'pgqueue sweep'"), (seed, order)
