"""What the message table's shape costs a Spark partition's COPY, on the server.

    python benchmarks/probes/spark_schema.py [--parallel 2] [--repeat 4] [VARIANT ...]

Copies of the message table (``CREATE TABLE ... (LIKE message INCLUDING ALL)``), each
changed one way, take the COPY that ``admin.load_staged``'s direct path sends (binary,
the message columns but ``eta``) from ``--parallel`` processes at once, each with 125,000
rows like ``benchmarks.spark_bench``'s, variants interleaved ``--repeat`` times. Prints
rows/s and the serving backends' CPU per row (``/proc``: the server must run here).

Variants: ``base`` (the table as migrated), ``fillfactor100`` (the heap without the room
0004_hot_claims leaves for claims), ``text_headers`` (headers and properties as text: no
JSON validation), ``collate_c`` (the dedup and ready indexes on ``COLLATE "C"`` text:
memcmp instead of strcoll), ``all`` (the three).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.probes.spark_split import (  # noqa: E402 - after the path
    DSN,
    _backend_cpu,
    _batches,
    _variants,
    _writer,
)

SCHEMA = "probe_spark_schema"
ROWS = 125_000
_C_INDEXES = (
    "DROP INDEX {s}.{n}_queue_dedup_key_idx",
    'CREATE UNIQUE INDEX ON {t} (queue COLLATE "C", dedup_key COLLATE "C")'
    " WHERE dedup_key IS NOT NULL",
    "DROP INDEX {s}.{n}_queue_priority_id_idx",
    'CREATE INDEX ON {t} (queue COLLATE "C", priority DESC, id) WHERE NOT delayed',
)
_FILLFACTOR = ("ALTER TABLE {t} SET (fillfactor = 100)",)
_TEXT = ("ALTER TABLE {t} ALTER headers TYPE text, ALTER properties TYPE text",)
VARIANTS: dict[str, tuple[str, ...]] = {
    "base": (),
    "fillfactor100": _FILLFACTOR,
    "text_headers": _TEXT,
    "collate_c": _C_INDEXES,
    "all": _FILLFACTOR + _TEXT + _C_INDEXES,
}


def _load(table: str, first: int, done: Any, start: Any) -> None:
    import psycopg
    from psycopg import sql

    from kombu_pgqueue.records import STAGING_COLUMNS

    messages = _variants()["columns"](_writer(), _batches(ROWS, first))
    rows = [row[:2] + row[3:] for row in messages]
    types = [kind for name, kind in STAGING_COLUMNS if name != "eta"]
    columns = [sql.Identifier(name) for name, _ in STAGING_COLUMNS if name != "eta"]
    statement = sql.SQL("COPY {}.{} ({}) FROM STDIN WITH (FORMAT BINARY)").format(
        sql.Identifier(SCHEMA), sql.Identifier(table), sql.SQL(", ").join(columns)
    )
    with psycopg.connect(DSN, autocommit=True) as conn:
        pid = conn.info.backend_pid
        start.wait()
        cpu, began = _backend_cpu(pid), time.perf_counter()
        with conn.transaction(), conn.cursor().copy(statement) as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(row)
        done.put((time.perf_counter() - began, _backend_cpu(pid) - cpu))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=4)
    opts = parser.parse_args()
    import psycopg
    from psycopg import sql

    from kombu_pgqueue import admin

    identifier = sql.Identifier(SCHEMA)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(identifier))
        admin.Broker(DSN, schema=SCHEMA).ensure_schema()
        for name in opts.variants:
            table = f"{SCHEMA}.{name}"
            conn.execute(f"CREATE TABLE {table} (LIKE {SCHEMA}.message INCLUDING ALL)")
            for statement in VARIANTS[name]:
                conn.execute(statement.format(t=table, s=SCHEMA, n=name))
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in opts.variants}
    first = 0
    for _ in range(opts.repeat):
        for name in opts.variants:
            done: Any = multiprocessing.Queue()
            start = multiprocessing.Barrier(opts.parallel)
            workers = []
            for _ in range(opts.parallel):
                workers.append(
                    multiprocessing.Process(target=_load, args=(name, first, done, start))
                )
                first += ROWS
            for worker in workers:
                worker.start()
            results = [done.get(timeout=600) for _ in workers]
            for worker in workers:
                worker.join()
            rows = ROWS * opts.parallel
            wall = max(seconds for seconds, _ in results)
            figures[name].append((rows / wall, sum(cpu for _, cpu in results) * 1e6 / rows))
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(identifier))
    print(f"{opts.parallel} x {ROWS:,} rows at once; median [min-max] of {opts.repeat} runs")
    for name, runs in figures.items():
        rates, cpus = [r for r, _ in runs], [c for _, c in runs]
        print(
            f"  {name:<14} {statistics.median(rates):9,.0f} rows/s [{min(rates):,.0f}-"
            f"{max(rates):,.0f}]   server {statistics.median(cpus):5.1f} us/row "
            f"[{min(cpus):.1f}-{max(cpus):.1f}]"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
