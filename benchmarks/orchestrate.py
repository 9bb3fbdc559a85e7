"""The order of the runs: run 1 of every broker, then run 2, ...; then claim and ETA/RSS."""

from __future__ import annotations

import faulthandler
import time
import traceback
from collections.abc import Callable
from typing import Any

from .atomic_drain import bench_atomic
from .celery_runs import bench_celery
from .config import STEP_WATCHDOG, Ctx, log
from .figures import ONLY_FOR
from .fleet import bench_fleet
from .kombu_runs import bench_kombu
from .listeners import bench_listeners
from .peers import Broker, close_sqla_sessions
from .probes_bulk import bench_bulk
from .probes_claim import bench_claim
from .probes_eta import bench_eta_rss
from .probes_idle import bench_idle
from .scale import bench_publishers

Results = dict[str, dict[str, list[float]]]


def celery_figures(groups: list[str]) -> set[str]:
    """What bench_celery measures for these groups."""
    want = set()
    if "celery_publish" in groups:
        want.add("celery_publish")
    if "drain" in groups:
        want.update(("drain_prefork", "drain_threads"))
    if "latency" in groups:
        want.add("latency")
    return want


def run_all(ctx: Ctx, groups: list[str]) -> Results:
    results: Results = {}
    live = [b for b in ctx.brokers.values() if b.available]

    def record(broker: Broker, values: dict[str, Any]) -> None:
        for key, value in values.items():
            vals = value if isinstance(value, list) else [value]
            results.setdefault(key, {}).setdefault(broker.name, []).extend(vals)

    def guarded(broker: Broker, label: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        # a step that hangs prints every thread's stack (then goes on waiting)
        faulthandler.dump_traceback_later(STEP_WATCHDOG, repeat=True)
        try:
            record(broker, fn())
        except Exception as exc:  # noqa: BLE001
            ctx.problem(
                broker.name, label, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            )
        finally:
            faulthandler.cancel_dump_traceback_later()
            if broker.name == "sqla":
                # Kombu's SQLAlchemy channel leaves its session idle in a transaction that
                # holds back the database's xmin horizon (no dead row anywhere in the
                # database, pgqueue's included, could be vacuumed): end it after each step
                close_sqla_sessions()
        log(f"  {broker.name:8s} {label:14s} {time.monotonic() - t0:6.1f}s")

    celery_want = celery_figures(groups)
    for run in range(ctx.runs):
        log(f"run {run + 1}/{ctx.runs}")
        for b in live:
            if "kombu" in groups:
                guarded(b, "kombu", lambda b=b, run=run: bench_kombu(ctx, b, run))
            if celery_want:
                guarded(
                    b,
                    "celery+latency",
                    lambda b=b, run=run: bench_celery(ctx, b, run, celery_want),
                )
            if "bulk" in groups and b.name in ONLY_FOR["bulk"]:
                guarded(b, "bulk", lambda b=b, run=run: bench_bulk(ctx, b, run))
            if "publishers" in groups:
                guarded(b, "publishers", lambda b=b, run=run: bench_publishers(ctx, b, run))
            if "atomic" in groups and b.name in ONLY_FOR["atomic"]:
                guarded(b, "atomic", lambda b=b, run=run: bench_atomic(ctx, b, run))
        idle = [b for b in live if b.name in ONLY_FOR["idle"]]
        if "idle" in groups and idle:
            t0 = time.monotonic()
            try:
                for name, values in bench_idle(ctx, idle, run).items():
                    record(ctx.brokers[name], values)
            except Exception as exc:  # noqa: BLE001
                ctx.problem(
                    ",".join(b.name for b in idle),
                    "idle",
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                )
            finally:
                if any(b.name == "sqla" for b in idle):
                    close_sqla_sessions()
            log(f"  {'+'.join(b.name for b in idle):8s} idle {time.monotonic() - t0:6.1f}s")
    if "claim" in groups and "pgqueue" in ctx.brokers and ctx.brokers["pgqueue"].available:
        log("claim cost (loaded once, measured --runs times)")
        guarded(ctx.brokers["pgqueue"], "claim", lambda: bench_claim(ctx, ctx.brokers["pgqueue"]))
    if "listeners" in groups and "pgqueue" in ctx.brokers:
        log("NOTIFY with many listening sessions (a throwaway cluster, --runs sweeps)")
        guarded(ctx.brokers["pgqueue"], "listeners", lambda: bench_listeners(ctx))
    if "fleet" in groups and "pgqueue" in ctx.brokers:
        log("a fleet of idle consumers, direct and through PgBouncer (a throwaway cluster)")
        guarded(ctx.brokers["pgqueue"], "fleet", lambda: bench_fleet(ctx))
    if "eta_rss" in groups:
        log("worker RSS with ETA tasks (one run)")
        for b in live:
            if b.name in ONLY_FOR["eta_rss"]:
                guarded(b, "eta_rss", lambda b=b: bench_eta_rss(ctx, b))
    return results
