"""What a transaction's BEGIN and COMMIT cost a psycopg client, whether psycopg's
pipeline mode (the one way to send BEGIN with the first statement) buys it back, and
what the way its end is sent costs.

    python benchmarks/probes/begin_cost.py [N] [--rounds R]

One connection to the local server, a one-row INSERT into a temporary table, N times
each way, the ways interleaved for R rounds; client CPU (process time) and wall time per
INSERT, medians over the rounds:

- ``transaction``: psycopg's default: BEGIN, the INSERT, COMMIT (three round trips:
  what an AtomicTask's body and ack are, the ack riding on the COMMIT);
- ``pipeline-begin``: BEGIN and the INSERT in one pipeline sync, then COMMIT;
- ``pipeline-all``: BEGIN, the INSERT and COMMIT in one pipeline;
- ``autocommit``: the INSERT alone (one round trip: a plain task's write);
- ``end-cursor``: the end as a simple query ``SELECT 1; COMMIT`` through a cursor
  (``conn.execute``: the shape of an AtomicTask's ack and COMMIT before 2026-11-27);
- ``end-exec_``: the same through ``PGconn.exec_`` (blocking libpq);
- ``end-send+wait``: the same sent with ``PGconn.send_query`` and waited for by
  ``conn.wait`` (an AtomicTask's ack now: psycopg's own wait, which a signal interrupts).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import psycopg
from psycopg import generators

DSN = "host=127.0.0.1 dbname=test user=postgres"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with psycopg.connect(DSN) as conn:
        conn.execute("CREATE TEMPORARY TABLE begin_cost (x int)")
        conn.commit()
        insert = "INSERT INTO begin_cost VALUES (%s)"

        def transaction(i: int) -> None:
            conn.execute(insert, (i,))
            conn.commit()

        def pipeline_begin(i: int) -> None:
            with conn.pipeline():
                conn.execute(insert, (i,))
            conn.commit()

        def pipeline_all(i: int) -> None:
            with conn.pipeline():
                conn.execute(insert, (i,))
                conn.commit()

        def autocommit(i: int) -> None:
            conn.autocommit = True
            conn.execute(insert, (i,))
            conn.autocommit = False

        end = b"SELECT 1; COMMIT"

        def end_cursor(i: int) -> None:
            conn.execute(insert, (i,))
            conn.execute(end)

        def end_exec(i: int) -> None:
            conn.execute(insert, (i,))
            conn.pgconn.exec_(end)

        def end_send_wait(i: int) -> None:
            conn.execute(insert, (i,))
            conn.pgconn.send_query(end)
            conn.wait(generators.execute(conn.pgconn))

        ways: dict[str, Callable[[int], None]] = {
            "transaction": transaction,
            "pipeline-begin": pipeline_begin,
            "pipeline-all": pipeline_all,
            "autocommit": autocommit,
            "end-cursor": end_cursor,
            "end-exec_": end_exec,
            "end-send+wait": end_send_wait,
        }
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                cpu, wall = time.process_time(), time.perf_counter()
                for i in range(args.n):
                    way(i)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                figures[name].append((cpu / args.n * 1e6, wall / args.n * 1e6))
    print(f"{args.n} INSERTs a way, medians of {args.rounds} rounds, us per INSERT")
    for name, runs in figures.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"{name:15s} client CPU {cpu:7.1f}   wall {wall:7.1f}")


if __name__ == "__main__":
    main()
