"""The ``eta_rss`` group: worker RSS with an empty queue and with N ETA tasks due tomorrow."""

from __future__ import annotations

import time

from .bench_app import make_app
from .config import Ctx, log
from .peers import Broker, declare, delete_queue, queue_size
from .workers import Worker


def bench_eta_rss(ctx: Ctx, broker: Broker) -> dict[str, list[float]]:
    """Worker RSS with an empty queue, then with eta_n tasks due tomorrow (one run)."""
    if broker.name == "sqla":
        ctx.notes.append("sqla: ETA/RSS figure skipped (publishing at ~150 tasks/s takes too long)")
        return {}
    n, cap = ctx.sizes["eta_n"], ctx.sizes["eta_settle_cap"]
    name = ctx.queue(broker, "eta")
    declare(broker, name)
    worker = Worker(ctx, broker, name, "prefork", 2, tag="eta")
    app = make_app(broker.url, broker.options, name)
    try:
        worker.wait_ready()
        time.sleep(3.0)
        empty = worker.rss_mb()
        noop = app.tasks["bench.noop"]
        t0 = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for _ in range(n):
                noop.apply_async(countdown=86400, producer=producer)
        log(f"  {broker.name}: published {n:,} ETA tasks in {time.perf_counter() - t0:.1f}s")
        # settle: until the broker has handed every ETA task to the worker and RSS is flat
        # for 5 s, or nothing changed for 10 s, at most eta_settle_cap seconds
        deadline = time.monotonic() + cap
        last_rss, last_size = worker.rss_mb(), queue_size(broker, name)
        rss_since = size_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            rss, size = worker.rss_mb(), queue_size(broker, name)
            now = time.monotonic()
            if abs(rss - last_rss) > 1.0:
                last_rss, rss_since = rss, now
            if size != last_size:
                last_size, size_since = size, now
            if size == 0 and now - rss_since >= 5:
                break
            if now - rss_since >= 10 and now - size_since >= 10:
                break
        full = worker.rss_mb()
        held = n - queue_size(broker, name)
        if worker.proc.poll() is not None:
            ctx.problem(broker.name, "rss_eta", f"worker died:\n{worker.log_tail()}")
        if held < n and not broker.name.startswith("pgqueue"):
            ctx.notes.append(
                f"{broker.name}: after {cap:.0f}s the worker had taken {held:,} of {n:,} "
                "ETA tasks (it would keep taking them)"
            )
        return {"rss_empty": [empty], "rss_eta": [full], "eta_held": [float(held)]}
    finally:
        worker.stop()
        app.close()
        delete_queue(broker, name)
