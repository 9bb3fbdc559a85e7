"""What the end of an atomic task's transaction costs a psycopg client, by how it is sent.

    python benchmarks/probes/ack_commit_cost.py [N] [--rounds R]

One connection to the local server; each transaction is one statement (``SELECT 1``,
which opens it) and its end, N times each way, the ways interleaved for R rounds; client
CPU (process time) per transaction, median and lowest over the rounds:

- ``cursor``: the end as a simple query through ``conn.execute`` (``SELECT 1; COMMIT``,
  the shape of the ack and COMMIT of an atomic task, before 2026-11-27);
- ``exec_``: the same query through psycopg's ``PGconn.exec_`` (blocking libpq);
- ``send+wait``: sent with ``PGconn.send_query`` and waited for by ``conn.wait`` (what it
  is now: psycopg's own wait, which a signal interrupts);
- ``commit``: psycopg's ``conn.commit()`` (a task in a transaction of its own).
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
    parser.add_argument("n", nargs="?", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with psycopg.connect(DSN) as conn:

        def cursor() -> None:
            conn.execute("SELECT 1")
            conn.execute(b"SELECT 1; COMMIT")

        def exec_() -> None:
            conn.execute("SELECT 1")
            conn.pgconn.exec_(b"SELECT 1; COMMIT")

        def send_wait() -> None:
            conn.execute("SELECT 1")
            conn.pgconn.send_query(b"SELECT 1; COMMIT")
            conn.wait(generators.execute(conn.pgconn))

        def commit() -> None:
            conn.execute("SELECT 1")
            conn.commit()

        ways: dict[str, Callable[[], None]] = {
            "cursor": cursor,
            "exec_": exec_,
            "send+wait": send_wait,
            "commit": commit,
        }
        seen: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                start = time.process_time()
                for _ in range(args.n):
                    way()
                seen[name].append(1e6 * (time.process_time() - start) / args.n)
    print(f"client CPU per transaction, us ({args.rounds} rounds of {args.n})")
    for name, values in seen.items():
        print(f"{name:10s} median {statistics.median(values):7.1f}  lowest {min(values):7.1f}")


if __name__ == "__main__":
    main()
