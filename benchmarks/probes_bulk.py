"""The ``bulk`` group (pgqueue only): Store.publish_rows, celery_pgqueue send_many, raw COPY."""

from __future__ import annotations

import json
import time

import psycopg

from .bench_app import make_app
from .config import SMALL_BODY, Ctx
from .peers import Broker
from .probes_claim import copy_rows, open_store


def bench_bulk(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    """Bulk enqueue into an empty queue: Kombu level (Store) and Celery level (send_many)."""
    if broker.name != "pgqueue":
        return {}
    from celery_pgqueue.bulk import send_many

    n = ctx.sizes["bulk_n"]
    store = open_store(ctx.settings, broker)
    body = json.dumps(SMALL_BODY).encode()
    queue = f"bulk{run}"
    headers = '{"id": "x"}'
    properties = '{"delivery_info": {"exchange": "", "routing_key": "bulk"}}'
    # staging rows with a distinct dedup key each, as task ids give them (built untimed)
    rows = [
        (queue, 0, None, None, f"bulk:{run}:{i}", body, "application/json", "utf-8")
        + (headers, properties)
        for i in range(n)
    ]
    store.publish_rows(rows[:10])
    store.purge(queue)
    batch = 10_000
    t0 = time.perf_counter()
    done = 0
    for start in range(0, n, batch):
        done += store.publish_rows(rows[start : start + batch])
    out = {"bulk_publish_rows": n / (time.perf_counter() - t0)}
    if done != n:
        ctx.problem(broker.name, "bulk", f"publish_rows stored {done} of {n}")
    del rows
    store.purge(queue)

    tasks = ctx.sizes["bulk_tasks"]
    app = make_app(broker.url, broker.options, queue)
    noop = app.tasks["bench.noop"]
    send_many(app, [noop.s() for _ in range(10)])
    store.purge(queue)
    signatures = [noop.s() for _ in range(tasks)]
    t0 = time.perf_counter()
    report = send_many(app, signatures)
    out["bulk_send_many"] = tasks / (time.perf_counter() - t0)
    if report.enqueued != tasks:
        ctx.problem(broker.name, "bulk", f"send_many enqueued {report.enqueued} of {tasks}")
    app.close()
    store.purge(queue)

    with psycopg.connect(ctx.settings.dsn, autocommit=True) as conn:
        out["bulk_copy"] = copy_rows(conn, broker.options["schema"], queue, n)
    store.delete_queue(queue)
    return out
