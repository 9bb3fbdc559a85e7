"""Scenarios with Kombu producer and consumer processes: load and snapshot."""

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
from kombu_pgqueue.bulk import publish_many
from kombu_pgqueue.embedded import broker_url

from . import ledger, procs
from .context import Context, Result

QUEUE = "chaos"
#: seconds per latency bucket
BUCKET = 10.0
#: latency samples kept per bucket and process
SAMPLES = 3000


def _connection(dsn: str, schema: str) -> Connection:
    # few pooled connections per process: 32 processes share max_connections = 100
    conn = Connection(
        broker_url(dsn),
        transport_options={"schema": schema, "pool_max_size": 2, "polling_interval": 1.0},
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
) -> None:
    """Consume until ``stop``; ack each message; report claim and end-to-end latencies."""
    rng = random.Random()
    conn = _connection(dsn, schema)
    channel = conn.default_channel
    claims: dict[int, list[float]] = defaultdict(list)
    e2e: dict[int, list[float]] = defaultdict(list)
    seen: list[tuple[int, int]] = []
    # the transport's consumer claims with fetch() when drain_events() runs without an
    # event loop, as here
    fetch = channel.consumer.fetch

    def timed_fetch(queue: str, limit: int, no_ack: bool, sink: Any) -> list[Any]:
        begun = time.perf_counter()
        rows = fetch(queue, limit, no_ack, sink)
        _keep(claims[int((time.time() - t0) // BUCKET)], time.perf_counter() - begun, rng)
        return rows

    channel.consumer.fetch = timed_fetch  # instrumentation of this process's consumer only

    def on_message(body: Any, message: Any) -> None:
        now = time.time()
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
            table = sql.Identifier("chaos_ledger", f"{run_id}_load")
            with cur.copy(sql.SQL("COPY {} (p, s) FROM STDIN").format(table)) as cp:
                for row in seen:
                    cp.write_row(row)
    results.put(("consumer", dict(claims), dict(e2e)))


def producer(dsn: str, schema: str, p: int, rate: float, stop: Any, results: Any) -> None:
    """Publish ``{"p", "s", "t"}`` at ``rate`` per second until ``stop``."""
    conn = _connection(dsn, schema)
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
        conn.execute(
            sql.SQL("CREATE TABLE {} (p int NOT NULL, s int NOT NULL)").format(
                sql.Identifier("chaos_ledger", f"{run.run_id}_load")
            )
        )
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
        table = sql.Identifier("chaos_ledger", f"{run.run_id}_load")
        rows = ledger.count(conn, sql.SQL("SELECT count(*) FROM {}").format(table))
        distinct = ledger.count(
            conn, sql.SQL("SELECT count(*) FROM (SELECT DISTINCT p, s FROM {}) d").format(table)
        )
        expected = {(r[1], s) for r in prods for s in range(r[2])} - failed_keys
        got = {
            (p, s) for p, s in conn.execute(sql.SQL("SELECT DISTINCT p, s FROM {}").format(table))
        }
        lost = len(expected - got)
        claims, e2e = _merge(cons, 1), _merge(cons, 2)
        seconds = run.elapsed()
        ok = (
            drained
            and len(prods) == n_prod
            and len(cons) == n_cons
            and lost == 0
            and rows == distinct
            and not failed
        )
        result = Result("load", ok, seconds=seconds)
        result.measures += [
            ("producers / consumers (processes)", f"{n_prod} / {n_cons}"),
            ("duration (s) / target publish rate (msg/s)", f"{minutes * 60:.0f} / {rate:.0f}"),
            ("published (believed)", published),
            ("publishes that raised", failed),
            ("consumed (rows)", rows),
            ("consumed (distinct)", distinct),
            ("lost", lost),
            ("executed more than once", rows - distinct),
            ("unexpected (consumed, never published)", len(got - expected)),
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


# -- 7. snapshot ---------------------------------------------------------------------------


def backlog_producer(
    dsn: str, schema: str, stop: Any, low: int, high: int, consumed: list[Any], dry: Any
) -> None:
    """Keep ``low`` to ``high`` messages waiting, in COPY batches of at most 1,000.

    The backlog is what this producer sent minus what the consumers counted (shared
    counters), not ``store.size()``: a count over the queue steps over every dead row an
    open snapshot keeps, which would make the producer, not the broker, the bottleneck.
    Small batches sent as soon as the backlog is under ``high`` keep the queue from
    running dry while a batch is built (one batch of ``high - low`` did, every time).
    """
    conn = _connection(dsn, schema)
    sent = 0
    while not stop.is_set():
        backlog = sent - sum(c.value for c in consumed)
        if backlog < high:
            batch = min(1000, high - backlog)
            publish_many(conn, ({"p": 0, "s": 0, "t": time.time()} for _ in range(batch)), QUEUE)
            sent += batch
        else:
            stop.wait(0.01)
        if backlog < low:
            dry.value += 1
    conn.release()


def snapshot(ctx: Context, vacuum_every: float) -> Result:
    hold = (ctx.minutes or (0.5 if ctx.quick else 5.0)) * 60
    before = after = 20.0 if ctx.quick else 60.0
    n_cons = 4
    mp = multiprocessing.get_context("spawn")
    with ctx.run("snapshot") as run, run.connect() as conn:
        stop_prod, stop_cons = mp.Event(), mp.Event()
        results = mp.Queue()
        t0 = time.time()
        counters = [mp.Value("q", 0, lock=False) for _ in range(n_cons)]
        dry = mp.Value("q", 0, lock=False)  # producer loops that found under `low` waiting
        workers = [
            mp.Process(
                target=consumer,
                args=(ctx.dsn, run.schema, run.run_id, t0, stop_cons, results, c, False),
            )
            for c in counters
        ] + [
            mp.Process(
                target=backlog_producer,
                args=(ctx.dsn, run.schema, stop_prod, 2000, 6000, counters, dry),
            )
        ]
        vac_stop = threading.Event()
        samples: list[tuple[float, int]] = []
        marks: dict[str, float] = {}
        stats: dict[str, dict[str, Any]] = {}
        holder = psycopg.connect(ctx.dsn, application_name="chaos-snapshot-holder")
        try:
            for p in workers:
                p.start()
            if vacuum_every:
                procs.vacuum_ticker(ctx.dsn, run.schema, vacuum_every, vac_stop)
            procs.wait_for(lambda: sum(c.value for c in counters) > 0, 60, "consumers to start")

            def sample_for(seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    samples.append((time.monotonic(), sum(c.value for c in counters)))
                    procs.pause(1.0)

            marks["before"] = time.monotonic()
            stats["start"] = procs.table_stats(conn, run.schema)
            sample_for(before)
            holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            holder.execute("SELECT count(*) FROM pg_class").fetchone()  # snapshot taken, then idle
            marks["during"] = time.monotonic()
            stats["hold begins"] = procs.table_stats(conn, run.schema)
            sample_for(hold)
            stats["hold ends"] = procs.table_stats(conn, run.schema)
            holder.rollback()
            marks["after"] = time.monotonic()
            sample_for(after)
            marks["end"] = time.monotonic()
            stats["end"] = procs.table_stats(conn, run.schema)
            stop_prod.set()
            stop_cons.set()
            reports = _drain_results(results, n_cons)
        finally:
            holder.close()
            stop_prod.set()
            stop_cons.set()
            vac_stop.set()
            for p in workers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()

        def rate(a: float, b: float) -> float:
            inside = [(t, v) for t, v in samples if a <= t <= b]
            if len(inside) < 2:
                return float("nan")
            return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

        r_before = rate(marks["before"], marks["during"])
        r_during = rate(marks["during"], marks["after"])
        r_after = rate(marks["after"], marks["end"])
        window = min(30.0, hold / 2)
        r_first = rate(marks["during"], marks["during"] + window)
        r_last = rate(marks["after"] - window, marks["after"])
        # "recovers when it ends": the after phase in 10 s windows, and the first window
        # from which every later one is back at 80 % of before
        steps = [marks["after"] + 10 * k for k in range(int(after // 10) + 1)]
        r_steps = [rate(a, b) for a, b in zip(steps, steps[1:])]
        recovered = next(
            (10 * k for k in range(len(r_steps)) if all(r >= 0.8 * r_before for r in r_steps[k:])),
            None,
        )
        claims = _merge(reports, 1)

        def claim_p50(a: str, b: str) -> str:
            # buckets count from t0 (wall clock); marks are monotonic
            shift = (time.time() - t0) - time.monotonic()
            lo, hi = int((marks[a] + shift) // BUCKET), int((marks[b] + shift) // BUCKET)
            values = [v for k in range(lo + 1, hi) for v in claims.get(k, [])]
            p50, p99 = _pct(values, 0.5) * 1000, _pct(values, 0.99) * 1000
            return f"claim p50 {p50:.1f} ms, p99 {p99:.1f} ms"

        ratio = r_during / r_before if r_before else float("nan")
        result = Result(
            "snapshot", ratio >= 0.5 and r_after >= 0.8 * r_before, seconds=run.elapsed()
        )
        result.measures += [
            ("consumers (processes, prefetch 20) / backlog kept", f"{n_cons} / 2000-6000"),
            ("producer loops that found the backlog under 2000", dry.value),
            ("phases before / hold / after (s)", f"{before:.0f} / {hold:.0f} / {after:.0f}"),
            (
                "VACUUM of the message table every (s), autovacuum is off here",
                vacuum_every or "never",
            ),
            ("throughput before (msg/s)", f"{r_before:.0f}; {claim_p50('before', 'during')}"),
            (
                "throughput during the open snapshot (msg/s)",
                f"{r_during:.0f} ({ratio:.0%} of before); {claim_p50('during', 'after')}",
            ),
            (
                f"  first {window:.0f} s / last {window:.0f} s of the hold",
                f"{r_first:.0f} / {r_last:.0f}",
            ),
            (
                "throughput after it ended (msg/s)",
                f"{r_after:.0f} ({r_after / r_before:.0%} of before); {claim_p50('after', 'end')}",
            ),
            (
                "  after, per 10 s (msg/s)",
                " / ".join(f"{r:.0f}" for r in r_steps),
            ),
            (
                "  back at >= 80 % of before, and staying there",
                "not within the after phase" if recovered is None else f"{recovered} s after",
            ),
        ]
        result.measures += [(f"message table, {k}", _fmt_stats(v)) for k, v in stats.items()]
        return result
