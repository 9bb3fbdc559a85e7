"""Scenarios with Kombu producer and consumer processes: load (and the processes that
the snapshot scenario, snapshot.py, runs too)."""

from __future__ import annotations

import multiprocessing
import queue as stdqueue
import random
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue
from psycopg import sql

import kombu_pgqueue  # noqa: F401 - registers pgqueue://
from kombu_pgqueue.embedded import broker_url

from . import ledger, procs
from .context import Context, Result

QUEUE = "chaos"
#: seconds per latency bucket
BUCKET = 10.0
#: latency samples kept per bucket and process
SAMPLES = 3000


def _connection(dsn: str, schema: str, options: dict[str, Any] | None = None) -> Connection:
    # few pooled connections per process: 32 processes share max_connections = 100
    conn = Connection(
        broker_url(dsn),
        transport_options={
            "schema": schema,
            "pool_max_size": 2,
            "polling_interval": 1.0,
            **(options or {}),
        },
    )
    conn.connect()
    return conn


def _keep(bucket: list[float], value: float, rng: random.Random) -> None:
    if len(bucket) < SAMPLES:
        bucket.append(value)
    else:
        bucket[rng.randrange(SAMPLES)] = value


def consumer(
    dsn: str,
    schema: str,
    run_id: str,
    t0: float,
    stop: Any,
    results: Any,
    counter: Any,
    record: bool,
    options: dict[str, Any] | None = None,
) -> None:
    """Consume until ``stop``; ack each message; report claim and end-to-end latencies.
    ``options``: transport options beside the scenario's own."""
    rng = random.Random()
    conn = _connection(dsn, schema, options)
    channel = conn.default_channel
    claims: dict[int, list[float]] = defaultdict(list)
    e2e: dict[int, list[float]] = defaultdict(list)
    seen: list[tuple[int, int]] = []
    #: (published at, delivery latency) of the priority probes (see snapshot)
    probes: list[tuple[float, float]] = []
    # the transport's consumer runs its claims with Store.run_claim when drain_events()
    # runs without an event loop, as here
    store = channel.consumer.store
    run_claim = store.run_claim

    def timed_run_claim(request: Any) -> Any:
        begun = time.perf_counter()
        result = run_claim(request)
        _keep(claims[int((time.time() - t0) // BUCKET)], time.perf_counter() - begun, rng)
        return result

    store.run_claim = timed_run_claim  # instrumentation of this process's consumer only

    def on_message(body: Any, message: Any) -> None:
        now = time.time()
        if body.get("probe"):
            probes.append((body["t"], now - body["t"]))
        _keep(e2e[int((now - t0) // BUCKET)], now - body["t"], rng)
        if record:
            seen.append((body["p"], body["s"]))
        message.ack()
        counter.value += 1

    with Consumer(conn, [Queue(QUEUE)], callbacks=[on_message], prefetch_count=20):
        while not stop.is_set():
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
    conn.release()
    if record and seen:
        with psycopg.connect(dsn, autocommit=True) as db, db.cursor() as cur:
            table = ledger.load_table(run_id)
            with cur.copy(sql.SQL("COPY {} (p, s) FROM STDIN").format(table)) as cp:
                for row in seen:
                    cp.write_row(row)
    results.put(("consumer", dict(claims), dict(e2e), probes))


def producer(
    dsn: str,
    schema: str,
    p: int,
    rate: float,
    stop: Any,
    results: Any,
    options: dict[str, Any] | None = None,
) -> None:
    """Publish ``{"p", "s", "t"}`` at ``rate`` per second until ``stop``."""
    conn = _connection(dsn, schema, options)
    out = Producer(conn)
    seq, failed = 0, []
    interval = 1.0 / rate if rate else 0.0
    due = time.monotonic()
    while not stop.is_set():
        try:
            out.publish({"p": p, "s": seq, "t": time.time()}, routing_key=QUEUE)
        except Exception:  # noqa: BLE001 - not believed published; reported
            failed.append(seq)
        seq += 1
        if interval:
            due += interval
            wait = due - time.monotonic()
            if wait > 0:
                stop.wait(wait)
    conn.release()
    results.put(("producer", p, seq, failed))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _merge(reports: list[tuple[Any, ...]], index: int) -> dict[int, list[float]]:
    merged: dict[int, list[float]] = defaultdict(list)
    for report in reports:
        for bucket, values in report[index].items():
            merged[bucket].extend(values)
    return merged


def _fmt_stats(stats: dict[str, Any]) -> str:
    indexes = ", ".join(f"{k} {v // 1024} kB" for k, v in stats["indexes"].items())
    return (
        f"n_dead_tup {stats['n_dead_tup']}, n_live_tup {stats['n_live_tup']}, "
        f"total {stats['total_bytes'] // 1024} kB "
        f"(heap {stats['heap_bytes'] // 1024} kB; {indexes})"
    )


def _drain_results(results: Any, expected: int, timeout: float = 120) -> list[tuple[Any, ...]]:
    got: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    while len(got) < expected and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=1))
        except stdqueue.Empty:
            pass
    return got


# -- 6. load -------------------------------------------------------------------------------


def load(ctx: Context, rate: float, vacuum_every: float) -> Result:
    minutes = ctx.minutes or (0.5 if ctx.quick else 5.0)
    n_prod = n_cons = 16
    mp = multiprocessing.get_context("spawn")
    with ctx.run("load") as run, run.connect() as conn:
        ledger.create_load_table(conn, run.run_id)
        start_stats = procs.table_stats(conn, run.schema)
        stop_prod, stop_cons = mp.Event(), mp.Event()
        results = mp.Queue()
        t0 = time.time()
        counters = [mp.Value("q", 0, lock=False) for _ in range(n_cons)]
        consumers = [
            mp.Process(
                target=consumer,
                args=(ctx.dsn, run.schema, run.run_id, t0, stop_cons, results, c, True),
            )
            for c in counters
        ]
        producers = [
            mp.Process(
                target=producer, args=(ctx.dsn, run.schema, p, rate / n_prod, stop_prod, results)
            )
            for p in range(n_prod)
        ]
        vac_stop = threading.Event()
        try:
            for p in consumers + producers:
                p.start()
            if vacuum_every:
                procs.vacuum_ticker(ctx.dsn, run.schema, vacuum_every, vac_stop)
            end = time.monotonic() + minutes * 60
            while time.monotonic() < end:
                procs.pause(min(15.0, max(end - time.monotonic(), 0.0)))
                print(
                    f"    {run.elapsed():5.0f}s  consumed {sum(c.value for c in counters)}"
                    f"  waiting {ledger.broker_leftovers(conn, run.schema)}"
                )
            stop_prod.set()
            reports = _drain_results(results, n_prod)
            drained = procs.wait_for(
                lambda: ledger.broker_leftovers(conn, run.schema) == 0, 300, "the queue to drain"
            )
            stop_cons.set()
            reports += _drain_results(results, n_cons)
        finally:
            stop_prod.set()
            stop_cons.set()
            vac_stop.set()
            for p in consumers + producers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        procs.pause(1.0)  # statistics reach pg_stat_user_tables within a second
        end_stats = procs.table_stats(conn, run.schema)
        prods = [r for r in reports if r[0] == "producer"]
        cons = [r for r in reports if r[0] == "consumer"]
        published = sum(r[2] - len(r[3]) for r in prods)
        failed = sum(len(r[3]) for r in prods)
        failed_keys = {(r[1], s) for r in prods for s in r[3]}
        expected = {(r[1], s) for r in prods for s in range(r[2])} - failed_keys
        counted = ledger.tally(conn, run.run_id, expected)
        claims, e2e = _merge(cons, 1), _merge(cons, 2)
        seconds = run.elapsed()
        ok = (
            drained
            and len(prods) == n_prod
            and len(cons) == n_cons
            and counted.lost == 0
            and counted.duplicated == 0
            and not failed
        )
        result = Result("load", ok, seconds=seconds)
        result.measures += [
            ("producers / consumers (processes)", f"{n_prod} / {n_cons}"),
            ("duration (s) / target publish rate (msg/s)", f"{minutes * 60:.0f} / {rate:.0f}"),
            ("published (believed)", published),
            ("publishes that raised", failed),
            ("consumed (rows)", counted.rows),
            ("consumed (distinct)", counted.distinct),
            ("lost", counted.lost),
            ("executed more than once", counted.duplicated),
            ("unexpected (consumed, never published)", counted.unexpected),
            (
                "VACUUM of the message table every (s), autovacuum is off here",
                vacuum_every or "never",
            ),
            ("message table at start", _fmt_stats(start_stats)),
            ("message table at end", _fmt_stats(end_stats)),
        ]
        for bucket in sorted(set(claims) | set(e2e)):
            c, e = claims.get(bucket, []), e2e.get(bucket, [])
            result.measures.append(
                (
                    f"t={bucket * BUCKET:4.0f}-{(bucket + 1) * BUCKET:.0f}s",
                    f"claim p50 {_pct(c, 0.5) * 1000:6.1f} ms p99 {_pct(c, 0.99) * 1000:6.1f} ms | "
                    f"publish->consume p50 {_pct(e, 0.5) * 1000:7.1f} ms "
                    f"p99 {_pct(e, 0.99) * 1000:7.1f} ms",
                )
            )
        return result
