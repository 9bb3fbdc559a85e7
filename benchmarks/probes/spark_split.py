"""One Spark partition's work without Spark: build the messages, then load them.

    python benchmarks/probes/spark_split.py [ROWS] [--variant NAME ...] [--repeat N]

ROWS (125,000: one of the benchmark's 8 partitions) rows like ``benchmarks.spark_bench``'s
(``url``, ``n``; the key column ``url``) go through the Spark writer's message builder,
then into a fresh schema, once per variant, variants interleaved ``--repeat`` times.
For each: the client's CPU per row (building and loading apart), the serving backend's
CPU per row (``/proc``, so the server must run on this machine) and WAL bytes per row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DSN = os.environ.get("PGQUEUE_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = "probe_spark_split"
TICK = os.sysconf("SC_CLK_TCK")


def _backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _writer(keyed: bool = True) -> Any:
    from celery import Celery

    from celery_pgqueue.spark._messages import _Template
    from celery_pgqueue.spark._rows import _Layout
    from celery_pgqueue.spark._writer import _Writer

    template = _Template(
        Celery(set_as_current=False), "app.tasks.scrape", queue=None, priority=None, keyed=keyed
    )
    layout = _Layout(
        names=("url", "n", "url")[: 3 if keyed else 2],
        spread=(0, 1, 0)[: 3 if keyed else 2],
        types=("string", "long", "string")[: 3 if keyed else 2],
        nargs=2,
        kwnames=(),
        nkeys=1 if keyed else 0,
        priority=None,
        eta=None,
        expires=None,
        convert=(),
        naive_utc=frozenset(),
    )
    return _Writer(
        template=template,
        layout=layout,
        conninfo=DSN,
        schema=SCHEMA,
        eta=None,
        expires=None,
        allow_nulls=False,
        max_bad_rows=10,
        max_failures=1,
        dry_run=False,
        after_partition=None,
    )


def _batches(n: int, start: int) -> list[Any]:
    """Arrow batches of 10,000 rows (Spark's spark.sql.execution.arrow.maxRecordsPerBatch)."""
    import pyarrow as pa

    batches = []
    for first in range(start, start + n, 10_000):
        numbers = range(first, min(first + 10_000, start + n))
        urls = pa.array([f"https://example.com/page/{i}" for i in numbers])
        batches.append(
            pa.RecordBatch.from_arrays([urls, pa.array(numbers, pa.int64())], ["_0", "_1"])
        )
    return batches


def _variants() -> dict[str, Callable[[Any, Any, list[Any]], int]]:
    """How a partition's messages are built: row by row, or by columns."""
    from dataclasses import replace

    from celery_pgqueue.spark._columns import _Columns
    from celery_pgqueue.spark._rows import _Tally

    def rows(writer: Any, batches: list[Any]) -> list[Any]:
        tally = _Tally(0, 0, 10)
        return list(writer._messages(writer._arrow_rows(writer._spread(iter(batches))), tally))

    def columns(writer: Any, batches: list[Any]) -> list[Any]:
        writer = replace(writer, columns=_Columns.plan(writer.template, writer.layout))
        return writer._by_columns(writer._spread(iter(batches)), _Tally(0, 0, 10))

    return {"rows": rows, "columns": columns}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="?", type=int, default=125_000)
    parser.add_argument("--variant", action="append")
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    import psycopg
    from psycopg import sql

    from kombu_pgqueue import admin

    variants = _variants()
    chosen = opts.variant or list(variants)
    writer = _writer()
    figures: dict[str, list[tuple[float, float, float, float]]] = {v: [] for v in chosen}
    start = 0
    with psycopg.connect(DSN, autocommit=True) as admin_conn:
        admin_conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA))
        )
        admin.Broker(DSN, schema=SCHEMA).ensure_schema()
        for _ in range(opts.repeat):
            for name in chosen:
                batches = _batches(opts.rows, start)
                start += opts.rows
                with psycopg.connect(DSN, autocommit=True) as conn:
                    pid = conn.info.backend_pid
                    lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
                    server = _backend_cpu(pid)
                    began = time.process_time()
                    messages = variants[name](writer, batches)
                    built = time.process_time()
                    done = admin.load_staged(
                        conn, messages, schema=SCHEMA, ordered=False, binary=True
                    )
                    ended = time.process_time()
                    server = _backend_cpu(pid) - server
                    wal = conn.execute(
                        "SELECT pg_current_wal_lsn() - %s::pg_lsn", (lsn,)
                    ).fetchone()[0]  # type: ignore[index]
                assert done == opts.rows, (name, done)
                per = 1e6 / opts.rows
                figures[name].append(
                    (
                        (built - began) * per,
                        (ended - built) * per,
                        server * per,
                        float(wal) / opts.rows,
                    )
                )
        admin_conn.execute(
            sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA))
        )
    print(f"{opts.rows:,} rows per load; us per row: median [min-max] over {opts.repeat} runs")
    for name, runs in figures.items():
        cols = []
        for i, label in enumerate(("build", "client load", "server", "WAL B/row")):
            vals = [r[i] for r in runs]
            cols.append(f"{label} {statistics.median(vals):6.1f} [{min(vals):.1f}-{max(vals):.1f}]")
        print(f"  {name:<14} " + "  ".join(cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
