"""Spark fan-out: rows/s of ``enqueue_dataframe`` into a fresh pgqueue schema.

    python benchmarks/spark_bench.py                         # PostgreSQL on 127.0.0.1
    python benchmarks/spark_bench.py --profile               # and where the time goes
    python benchmarks/spark_bench.py --embedded              # a throwaway PostgreSQL 18
    PGQUEUE_DSN=postgresql://... python benchmarks/spark_bench.py
    python -m benchmarks.spark_bench                         # the same, from the repo root

Needs the package importable: ``pip install -e .`` (Spark's Python workers import it too).

1,000,000 rows in 8 partitions on ``local[2]``: a first run, then an identical re-run that
must enqueue nothing new. The Spark session start, and the first Python job (Spark starts
its Python workers and warms the JVM there), are timed apart from the runs.

Wall-clock rows/s depend on whatever else the machine runs, so each run also counts the
CPU-seconds it cost (Linux ``/proc``): Spark's JVM, its Python workers, and the PostgreSQL
backends serving them (application_name ``pgqueue-spark``), and gives the rows/s those
CPU-seconds allow on this machine's CPUs when nothing else runs. ``--profile`` adds where
the time goes: Spark handing rows to Python, building messages, COPY, and the INSERT.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from time import perf_counter

DEFAULT_DSN = "host=127.0.0.1 dbname=test user=postgres"
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _count_rows(rows):  # a partition's rows handed to Python and nothing more
    yield sum(1 for _ in rows)


def _count_batches(batches):  # the same through Arrow, to Python values
    import pyarrow as pa

    count = 0
    for batch in batches:
        count += sum(1 for _ in zip(*(column.to_pylist() for column in batch.columns)))
    yield pa.RecordBatch.from_pylist([{"rows": count}])


def _stat(pid: int) -> tuple[float, int, str] | None:
    """(CPU-seconds, parent pid, command) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            head, tail = f.read().rsplit(")", 1)
    except OSError:
        return None
    fields = tail.split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[1]), head.split("(", 1)[1]


class CpuMeter:
    """Last-seen CPU-seconds of this process's descendants and of the pipeline's backends.

    Polled every 0.1 s, since Spark's Python workers and the per-partition backends come
    and go; a process's last tenth of a second can be missed.
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.seen: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        import psycopg

        query = "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgqueue-spark'"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                found = {
                    pid: _stat(pid) for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                }
                ours = {os.getpid()}
                grew = True
                while grew:
                    grew = False
                    for pid, stat in found.items():
                        if stat and stat[1] in ours and pid not in ours:
                            ours.add(pid)
                            grew = True
                for pid in ours - {os.getpid()}:
                    cpu, _, command = found[pid]  # type: ignore[misc]
                    kind = "Spark JVM" if "java" in command else "Spark Python workers"
                    self.seen[pid] = (kind, cpu)
                for (pid,) in conn.execute(query).fetchall():
                    stat = _stat(pid)
                    if stat:
                        self.seen[pid] = ("PostgreSQL backends", stat[0])
                self.stop.wait(0.1)

    def snapshot(self) -> dict[int, tuple[str, float]]:
        return dict(self.seen)

    def since(self, before: dict[int, tuple[str, float]]) -> dict[str, float]:
        spent: dict[str, float] = {}
        for pid, (kind, cpu) in self.seen.items():
            spent[kind] = spent.get(kind, 0.0) + cpu - before.get(pid, (kind, 0.0))[1]
        return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--dsn", default=os.environ.get("PGQUEUE_DSN", DEFAULT_DSN))
    parser.add_argument("--embedded", action="store_true", help="a throwaway PostgreSQL 18")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--transfer", choices=("auto", "arrow", "rows"), default="auto")
    opts = parser.parse_args()

    import psycopg
    from psycopg import sql

    from celery_pgqueue.spark import enqueue_dataframe
    from celery_pgqueue.spark._driver import _arrow_available
    from kombu_pgqueue import embedded

    if opts.embedded:
        opts.dsn = embedded.start()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())  # before Spark adds its own
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    began = perf_counter()
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master(opts.master)
        .appName("pgqueue-spark-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(opts.partitions))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    session = perf_counter() - began
    began = perf_counter()
    spark.sparkContext.parallelize(range(1000), 2).map(lambda x: x).count()
    warmup = perf_counter() - began
    meter = CpuMeter(opts.dsn) if os.path.isdir("/proc") else None

    df = spark.range(0, opts.rows, numPartitions=opts.partitions).select(
        F.concat(F.lit("https://example.com/page/"), F.col("id").cast("string")).alias("url"),
        F.col("id").alias("n"),
    )
    schema = f"spark_bench_{uuid.uuid4().hex[:8]}"
    kwargs = dict(
        task="app.tasks.scrape", args=["url", "n"], dedup_key="url", transfer=opts.transfer
    )
    arrow = opts.transfer == "arrow" or (opts.transfer == "auto" and _arrow_available())
    cpus = os.cpu_count() or 1
    print(
        f"{opts.rows:,} rows in {opts.partitions} partitions on {opts.master}, "
        f"schema {schema}, rows reach Python as {'Arrow batches' if arrow else 'pickled rows'}"
    )
    print(f"  load average before (1, 5, 15 min): {load} on {cpus} CPUs")
    print(f"  spark session start       {session:7.2f} s")
    print(f"  first Python job (warm-up){warmup:7.2f} s")
    ok = False
    try:
        runs = []
        for label in ("first run", "identical re-run"):
            before = meter.snapshot() if meter else {}
            summary = enqueue_dataframe(df, dsn=opts.dsn, schema=schema, **kwargs)
            runs.append(summary)
            rate = opts.rows / summary.seconds
            print(
                f"  {label:<25} {summary.seconds:7.2f} s  {rate:>9,.0f} rows/s"
                f"  enqueued {summary.enqueued:,}  skipped {summary.skipped:,}"
                f"  bad {summary.bad}  failed partitions {len(summary.partitions_failed)}"
            )
            if meter:
                meter.stop.wait(0.3)  # the last backends' final tenth
                spent = meter.since(before)
                total = sum(spent.values())
                parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(spent.items()))
                print(
                    f"    CPU-seconds {total:.1f} ({parts}): "
                    f"{opts.rows / (total / cpus):,.0f} rows/s on {cpus} idle CPUs"
                )
        first, again = runs
        ok = (
            first.enqueued == opts.rows
            and again.enqueued == 0
            and again.skipped == opts.rows
            and first.ok
            and again.ok
        )
        if opts.profile:
            _profile(df, opts, schema, kwargs, first, arrow)
    finally:
        if meter:
            meter.stop.set()
        with psycopg.connect(opts.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        spark.stop()
    print("ok" if ok else "FAIL: the runs did not enqueue every row once")
    return 0 if ok else 1


def _profile(df, opts, schema, kwargs, first, arrow) -> None:
    from celery_pgqueue.spark import enqueue_dataframe

    began = perf_counter()
    if arrow:
        df.mapInArrow(_count_batches, "rows long").collect()
    else:
        df.rdd.mapPartitions(_count_rows).collect()
    read = perf_counter() - began
    dry = enqueue_dataframe(df, dsn=opts.dsn, schema=schema, dry_run=True, **kwargs)
    per_row = 1e6 / opts.rows
    print("  where the first run's time goes, wall clock (2 partitions at a time):")
    print(f"    Spark hands the rows to Python      {read:7.2f} s")
    print(f"    ... and Python builds the messages  {dry.seconds:7.2f} s  (dry run: no writes)")
    print(f"    ... and the writes (first run)      {first.seconds:7.2f} s")
    print("  time inside the partitions, summed over partitions, per row:")
    print(f"    read + build messages       {dry.copy_seconds * per_row:5.1f} us")
    print(f"    COPY (+ staging INSERT)     {first.insert_seconds * per_row:5.1f} us  (+ commit)")


if __name__ == "__main__":
    raise SystemExit(main())
