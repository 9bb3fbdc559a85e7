"""What a claim of B and the ack of what it claimed cost the server, per message, as a
consumer sends them one after the other (message_cost.py claims everything first, so
its claims also walk the leased rows before them).

    python benchmarks/probes/claim_ack_cost.py [--n 16000] [--batch 8] [--detach-next] [--keys]

Run from a checkout (its kombu_pgqueue first on sys.path: ``PYTHONPATH=.``), or
through ``ab.sh`` to compare revisions. A schema of its own, N messages by
``Store.publish_many``, then claim(B) and ack_many of those B until the queue is
empty, on the store's pooled connections. Prints the wall time per claim and ack, and
the CPU per message of every PostgreSQL process (from /proc) and of the busiest one
(the backend that ran them). ``--detach-next`` first detaches the generation attached
ahead, empty until the next rotation: what one more partition in every statement
costs. ``--keys`` gives every message a dedup key of its own, as Celery's task ids are
(``dedup_task_ids``): what freeing the keys costs the acks.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import psycopg
from psycopg import sql

from kombu_pgqueue import migrate
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Store, new_lease
from kombu_pgqueue.records import Outgoing

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")
TICKS = os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> dict[int, int]:
    """pid -> CPU ticks (user + system) of every process named postgres."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "postgres" in stat.split(")")[0]:
            fields = stat.rsplit(")", 1)[1].split()
            out[int(entry)] = int(fields[11]) + int(fields[12])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16_000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--detach-next", action="store_true")
    parser.add_argument("--keys", action="store_true")
    args = parser.parse_args()
    schema = "probe_ca_" + uuid.uuid4().hex[:8]
    with psycopg.connect(DSN, autocommit=True) as pg:
        migrate(pg, schema)
        try:
            if args.detach_next:
                pg.execute(
                    sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(
                        sql.Identifier(schema, "message_store"),
                        sql.Identifier(schema, "message_store_2"),
                    )
                )
            run(schema, args.n, args.batch, args.keys)
        finally:
            pg.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def run(schema: str, n: int, batch: int, keys: bool) -> None:
    store = Store(DSN, parse_options({"schema": schema}))
    store.open()
    store.publish_many(
        [
            Outgoing(
                queue="q",
                body=b"x" * 100,
                headers="{}",
                properties="{}",
                dedup_key=uuid.uuid4().hex if keys else None,
            )
            for _ in range(n)
        ]
    )
    before, t0 = postgres_cpu(), time.perf_counter()
    got = rounds = 0
    while True:
        lease = new_lease()
        rows = store.claim("q", batch, lease)
        if not rows:
            break
        store.ack_many([d.id for d in rows], [lease] * len(rows))
        got += len(rows)
        rounds += 1
    wall, after = time.perf_counter() - t0, postgres_cpu()
    spent = {pid: after[pid] - before.get(pid, 0) for pid in after}
    store.pool.close()
    print(
        f"{got} messages, {rounds} claims of {batch}: {1e6 * wall / rounds:.0f} us a claim "
        f"and its ack; server CPU {1e6 * sum(spent.values()) / TICKS / got:.1f} us a "
        f"message, the busiest process {1e6 * max(spent.values()) / TICKS / got:.1f}"
    )


if __name__ == "__main__":
    main()
