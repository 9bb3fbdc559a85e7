"""The Celery groups: apply_async rate, drain by a real worker, apply_async -> start latency."""

from __future__ import annotations

import statistics
import time

from .bench_app import make_app
from .config import Ctx
from .peers import Broker, declare, delete_queue
from .workers import Worker


def publish_backlog(ctx: Ctx, broker: Broker, name: str, n: int) -> tuple[int, float]:
    """apply_async up to n no-op tasks from this process (time-capped); return (count, tasks/s)."""
    cap = ctx.sizes["publish_cap"]
    declare(broker, name)
    app = make_app(broker.url, broker.options, name)
    try:
        noop = app.tasks["bench.noop"]
        for _ in range(20):  # warm-up: connection, producer pool, declarations, prepares
            noop.apply_async()
        sent = 20
        t0 = time.perf_counter()
        while sent < n:
            noop.apply_async()
            sent += 1
            if sent % 100 == 0 and time.perf_counter() - t0 > cap:
                break
        rate = (sent - 20) / (time.perf_counter() - t0)
        if sent < n:
            ctx.notes.append(
                f"{broker.name}: Celery backlog publishing stopped at the {cap:.0f}s cap "
                f"({sent} of {n} tasks); drain figures use that backlog"
            )
        return sent, rate
    finally:
        app.close()


def drain(ctx: Ctx, worker: Worker, broker: Broker, n: int, figure: str) -> float | None:
    """Wait until the worker has run n tasks; return tasks/s first start -> last end."""
    deadline = time.monotonic() + ctx.sizes["drain_timeout"]
    sink = worker.sink
    while time.monotonic() < deadline:
        sink.read()
        if len(sink.done) >= n:
            break
        if worker.proc.poll() is not None:
            ctx.problem(broker.name, figure, f"worker died:\n{worker.log_tail()}")
            return None
        time.sleep(0.05)
    time.sleep(0.3)  # catch duplicates that arrive late
    sink.read()
    ids = [d[2] for d in sink.done]
    unique = len(set(ids))
    if unique < n:
        ctx.problem(
            broker.name,
            figure,
            f"only {unique} of {n} tasks ran within {ctx.sizes['drain_timeout']:.0f}s "
            f"(cmd: {' '.join(worker.cmd)}; log tail:\n{worker.log_tail(15)})",
        )
        return None
    if len(ids) > unique:
        ctx.problem(broker.name, figure, f"{len(ids) - unique} tasks ran twice")
    first = min(d[0] for d in sink.done)
    last = max(d[1] for d in sink.done)
    return n / (last - first)


def measure_latency(
    ctx: Ctx, worker: Worker, broker: Broker, name: str, run: int
) -> dict[str, float]:
    """Sequential apply_async -> task start on an idle worker consuming queue name."""
    n, cap = ctx.sizes["latency_n"], ctx.sizes["latency_cap"]
    app = make_app(broker.url, broker.options, name)
    out: dict[str, float] = {}
    try:
        worker.wait_ready()
        time.sleep(1.0)
        task = app.tasks["bench.latency"]
        sink = worker.sink
        samples: list[float] = []
        lost = 0
        warmup = 5
        t_start = time.monotonic()
        for i in range(warmup + n):
            have = len(sink.latency)
            task.apply_async((time.time(),))
            wait_until = time.monotonic() + 15.0
            while len(sink.latency) == have and time.monotonic() < wait_until:
                time.sleep(0.001)
                sink.read()
            if len(sink.latency) == have:
                lost += 1
                continue
            sent, started = sink.latency[-1]
            if i >= warmup:
                samples.append((started - sent) * 1000.0)
            # let the worker go idle again: past the transport option
            # idle_inline_seconds (0.02), so that an idle worker's claim is the inline
            # one whatever the harness's own delay
            time.sleep(0.05)
            if i >= warmup + ctx.sizes["latency_min"] and time.monotonic() - t_start > cap:
                break
        if lost:
            ctx.problem(broker.name, "latency", f"{lost} latency tasks did not start within 15s")
        if len(samples) < n:
            ctx.notes.append(
                f"{broker.name}: latency stopped at the {cap:.0f}s cap "
                f"with {len(samples)} of {n} samples (run {run + 1})"
            )
        if len(samples) >= min(10, ctx.sizes["latency_min"]):
            qs = statistics.quantiles(samples, n=100, method="inclusive")
            out.update(
                latency_p50=statistics.median(samples), latency_p95=qs[94], latency_p99=qs[98]
            )
    finally:
        app.close()
    return out


def bench_celery(ctx: Ctx, broker: Broker, run: int, want: set[str]) -> dict[str, float]:
    """Celery publish, drain (prefork, threads) and latency (on the prefork worker once idle)."""
    n = ctx.sizes["celery_n"]
    out: dict[str, float] = {}
    plans: list[tuple[str, str, int]] = []
    if want & {"drain_prefork", "latency"}:
        plans.append(("prefork", "prefork", 2))
    if "drain_threads" in want:
        plans.append(("threads", "threads", 8))
    if not plans:
        plans.append(("publish", "", 0))
    for tag, pool, conc in plans:
        name = ctx.queue(broker, f"c{run}{tag[:3]}")
        worker: Worker | None = None
        try:
            backlog = 0
            if "celery_publish" in want or f"drain_{tag}" in want:
                backlog, rate = publish_backlog(ctx, broker, name, n)
                if "celery_publish" in want and "celery_publish" not in out:
                    out["celery_publish"] = rate
            else:
                declare(broker, name)
            if not pool:
                continue
            worker = Worker(ctx, broker, name, pool, conc, tag=tag)
            if f"drain_{tag}" in want and backlog:
                r = drain(ctx, worker, broker, backlog, f"drain_{tag}")
                if r is not None:
                    out[f"drain_{tag}"] = r
            if tag == "prefork" and "latency" in want:
                out.update(measure_latency(ctx, worker, broker, name, run))
        finally:
            if worker is not None:
                worker.stop()
                if worker.killed:
                    ctx.notes.append(
                        f"{broker.name}: the {pool} worker did not exit within 5s of "
                        "SIGTERM and was killed"
                    )
            delete_queue(broker, name)
    return out
