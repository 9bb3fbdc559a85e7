"""The Spark pipeline end to end: a DataFrame of 100,000 rows becomes 100,000 Celery tasks.

    python examples/spark_demo.py            # embedded PostgreSQL, local Spark
    PGQUEUE_DSN=postgresql://... python examples/spark_demo.py

It builds the DataFrame on ``local[2]``, enqueues one ``spark_demo.scrape`` task per row
(a few rows have no URL: they are reported, not sent), enqueues the same DataFrame again
(nothing new), then starts a Celery worker and watches it drain the queue. Every 1000th
task rejects itself, so the dead letters, read back as a Spark DataFrame, have something
to count. Exit status 0 means every number came out right. Needs ``pip install pyspark``
and Java 17.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from time import monotonic

from celery import Celery
from celery.exceptions import Reject

import celery_pgqueue

HERE = Path(__file__).resolve().parent
TASK = "spark_demo.scrape"
ROWS = int(os.environ.get("SPARK_DEMO_ROWS", "100000"))
GAP = ROWS // 4  # the rows n % GAP == 7 have no URL: 4 bad rows


def make_app(dsn: str, schema: str) -> Celery:
    app = Celery("spark_demo", set_as_current=False)
    celery_pgqueue.configure(app, dsn, schema=schema, results=False)
    app.conf.update(worker_prefetch_multiplier=64, worker_hijack_root_logger=False)

    @app.task(name=TASK, acks_late=True, ignore_result=True, shared=False)
    def scrape(url: str, n: int) -> str:
        if n % 1000 == 999:
            raise Reject("the page is gone", requeue=False)  # -> a dead letter
        return hashlib.sha256(url.encode()).hexdigest()

    return app


if __name__ != "__main__" and "SPARK_DEMO_SCHEMA" in os.environ:
    # the worker's app: celery -A spark_demo worker
    app = make_app(os.environ["PGQUEUE_DSN"], os.environ["SPARK_DEMO_SCHEMA"])


def main() -> int:
    import psycopg
    from psycopg import sql

    from kombu_pgqueue import embedded

    dsn = os.environ.get("PGQUEUE_DSN")
    if not dsn:
        print("no PGQUEUE_DSN: starting an embedded PostgreSQL ...", flush=True)
        dsn = embedded.start()
    schema = f"spark_demo_{uuid.uuid4().hex[:8]}"
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    began = monotonic()
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("pgqueue-spark-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark {spark.version} on local[2] started in {monotonic() - began:.1f}s", flush=True)
    try:
        return _demo(spark, dsn, schema, F)
    finally:
        spark.stop()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _demo(spark, dsn: str, schema: str, F) -> int:
    from celery_pgqueue.spark import (
        dead_letters_dataframe,
        enqueue_dataframe,
        queue_stats_dataframe,
    )

    url = F.concat(F.lit("https://example.com/page/"), F.col("id").cast("string"))
    df = spark.range(0, ROWS, numPartitions=4).select(
        F.when(F.col("id") % GAP != 7, url).alias("url"),
        F.col("id").alias("n"),
    )
    send = dict(task=TASK, args=["url", "n"], dedup_key="n", dsn=dsn, schema=schema)
    first = enqueue_dataframe(df, **send)
    print(
        f"enqueued {first.enqueued:,} of {first.rows:,} rows in {first.seconds:.1f}s "
        f"({first.rows / first.seconds:,.0f} rows/s), {first.bad} bad rows:"
    )
    for bad in first.bad_rows:
        print(f"  partition {bad.partition} row {bad.index}: {bad.reason}  {bad.row}")
    again = enqueue_dataframe(df, **send)
    print(f"the same DataFrame again: {again.enqueued} new, {again.skipped:,} already waiting")

    env = {**os.environ, "PGQUEUE_DSN": dsn, "SPARK_DEMO_SCHEMA": schema, "PYTHONPATH": str(HERE)}
    # a thread pool: the tasks are I/O-shaped (a scraper), and it drains fastest here
    command = "worker --pool threads --concurrency 8 --loglevel error --without-mingle"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "spark_demo", "--quiet", *command.split()]
        + ["--without-gossip", "-n", f"spark-demo-{os.getpid()}@%h"],
        cwd=HERE,
        env=env,
    )
    try:
        drained = _watch(spark, dsn, schema, queue_stats_dataframe, deadline=600)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    dead = dead_letters_dataframe(spark, dsn, schema=schema)
    print("dead letters by task and reason:")
    dead.groupBy("task", "reason").count().show()
    dead_count = dead.count()
    dead_want = ROWS // 1000
    checks = {
        f"{ROWS - 4:,} tasks enqueued, 4 bad rows reported": (first.enqueued, first.bad)
        == (ROWS - 4, 4),
        "the re-run enqueued nothing": again.enqueued == 0 and again.skipped == ROWS - 4,
        "the worker drained the queue": drained,
        f"{dead_want} tasks dead-lettered (every 1000th)": dead_count == dead_want,
    }
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"{sum(checks.values())}/{len(checks)} checks passed", flush=True)
    return 0 if all(checks.values()) else 1


def _watch(spark, dsn: str, schema: str, queue_stats_dataframe, deadline: float) -> bool:
    began = monotonic()
    tick = threading.Event()
    while monotonic() - began < deadline:
        stats = {r["queue"]: r for r in queue_stats_dataframe(spark, dsn, schema=schema).collect()}
        row = stats.get("celery")
        waiting = (row["ready"] + row["leased"]) if row else 0
        print(f"  {monotonic() - began:5.1f}s  waiting or running: {waiting:>7,}", flush=True)
        if waiting == 0:
            return True
        tick.wait(2.0)
    return False


if __name__ == "__main__":
    raise SystemExit(main())
