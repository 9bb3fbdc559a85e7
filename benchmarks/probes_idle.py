"""The ``idle`` group: what an idle worker of a PostgreSQL broker sends, through pgproxy."""

from __future__ import annotations

import re
import time
from collections import Counter

from .config import Ctx
from .peers import Broker, declare, delete_queue
from .pgproxy import CountingProxy
from .workers import Worker


def describe_trace(trace: list[tuple[float, str, bytes]], seconds: float) -> str:
    """Executed statements by their first line, per minute, from a proxy trace."""
    names: dict[bytes, str] = {}
    counts: Counter[str] = Counter()

    def label(query: bytes) -> str:
        text = query.decode(errors="replace").strip()
        first = text.splitlines()[0] if text else "?"
        return re.sub(r"\s+", " ", first)[:60]

    for _, kind, payload in trace:
        if kind == "P":
            name, _, rest = payload.partition(b"\0")
            names[name] = label(rest.split(b"\0")[0])
        elif kind == "B":
            _, _, rest = payload.partition(b"\0")
            stmt = rest.split(b"\0")[0]
            counts[names.get(stmt, "?")] += 1
        elif kind == "Q":
            counts[label(payload.rstrip(b"\0"))] += 1
    per_min = 60.0 / seconds if seconds else 0.0
    return "; ".join(f"{n * per_min:.0f} x {name!r}" for name, n in counts.most_common(8)) or "none"


def bench_idle(ctx: Ctx, brokers: list[Broker], run: int) -> dict[str, dict[str, float]]:
    """Idle prefork -c 2 workers of the PostgreSQL brokers, side by side, each behind its
    own counting proxy (idle workers only wake on timers, so they do not disturb each other)."""
    setups = []
    try:
        for broker in brokers:
            name = ctx.queue(broker, f"i{run}")
            declare(broker, name)
            proxy = CountingProxy(ctx.settings.pg_hostport)
            worker = Worker(
                ctx, broker, name, "prefork", 2, url=broker.url_via(proxy.port), tag="idle"
            )
            setups.append((broker, name, proxy, worker))
        for _, _, _, worker in setups:
            worker.wait_ready()
        time.sleep(ctx.sizes["idle_settle"])
        before = [proxy.snapshot() for _, _, proxy, _ in setups]
        for _, _, proxy, _ in setups:
            proxy.trace = []
        t0 = time.monotonic()
        time.sleep(ctx.sizes["idle_window"])
        after = [proxy.snapshot() for _, _, proxy, _ in setups]
        dt = time.monotonic() - t0
        if run == 0:
            for broker, _, proxy, _ in setups:
                ctx.notes.append(
                    f"{broker.name}: idle worker statements by kind, per minute: "
                    + describe_trace(proxy.trace or [], dt)
                )
        out = {}
        for (broker, _, _, _), a, b in zip(setups, before, after):
            out[broker.name] = {
                "idle_stmts": (b["statements"] - a["statements"]) / dt,
                "idle_trips": (b["round_trips"] - a["round_trips"]) / dt,
                "idle_conns": float(b["open_connections"]),
            }
        return out
    finally:
        for broker, name, proxy, worker in setups:
            worker.stop()
            proxy.close()
            delete_queue(broker, name)
