"""What a message costs the server while drained generations pile up (issue 30): a
pg_dump keeps them from being dropped until it ends, so a long dump leaves dozens
attached, and a statement that opens each of them pays for all.

    python benchmarks/probes/generation_cost.py [--extra 0,30,62] [--n 10000]
        [--batch 20] [--rounds 3] [--checkouts /tmp/before:/work/main]

For each checkout (a directory holding kombu_pgqueue, run in a subprocess with it first
on sys.path), in rounds that interleave the checkouts and the numbers of extra
generations: a fresh schema given ``--extra`` drained and emptied generations before the
current one (as a dump leaves them), ``--n`` publishes one by one, claims of ``--batch``
until the queue is empty, and acks of each claimed batch. Server CPU is the user and
system time of every process of the PostgreSQL server (read from /proc), so the machine
should be otherwise quiet. Printed: the median and range over the rounds, per message,
for each phase, and each checkout's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from message_cost import SERVER_CPU  # run as a script: its folder is on sys.path

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")

_HEAD = r"""
import json, os, sys, uuid
import psycopg
from psycopg import sql
from kombu_pgqueue import migrate
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Outgoing, Store, new_lease

dsn, extra, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
schema = "gcost_" + uuid.uuid4().hex[:8]
ticks = os.sysconf("SC_CLK_TCK")


"""

_BODY = r"""

with psycopg.connect(dsn, autocommit=True) as conn:
    migrate(conn, schema)
    s = sql.Identifier(schema)
    # generations 1 .. extra drained and emptied, extra + 1 current, extra + 2 next
    for g in range(3, extra + 3):
        conn.execute(sql.SQL("SELECT {}.add_generation(%s)").format(s), (g,))
    if extra:
        cur = extra + 1
        conn.execute(
            sql.SQL("UPDATE {}.generation SET state = CASE WHEN gen < %s THEN 'emptied'"
                    " WHEN gen = %s THEN 'current' ELSE 'next' END").format(s), (cur, cur))
        conn.execute("SELECT setval(%s::regclass, %s, true)", (f"{schema}.generation_seq", cur))
        conn.execute(sql.SQL("UPDATE {}.rotation SET oldest = %s").format(s), (cur,))
    # no rotation during the run: the generations stay as set
    store = Store(dsn, parse_options({"schema": schema, "rotate_interval": 3600}))
    message = Outgoing(queue="q", body=b'{"task": "t", "args": [1, 2]}', headers="{}",
                       properties="{}")
    for _ in range(50):  # connections warm, statements prepared
        store.publish(message)
        store.ack_many([d.id for d in store.claim("q", 1, 1)], [1])
    c0 = server_cpu(conn)
    for _ in range(n):
        store.publish(message)
    c1 = server_cpu(conn)
    claimed = []
    while True:
        lease = new_lease()
        got = store.claim("q", batch, lease)
        if not got:
            break
        claimed.append(([d.id for d in got], lease))
    c2 = server_cpu(conn)
    for ids, lease in claimed:
        store.ack_many(ids, [lease] * len(ids))
    c3 = server_cpu(conn)
    assert sum(len(ids) for ids, _ in claimed) == n, "every message claimed once"
    store.pool.close()
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(s))
print(json.dumps({"publish": (c1 - c0) / n * 1e6, "claim": (c2 - c1) / n * 1e6,
                  "ack": (c3 - c2) / n * 1e6}))
"""

#: what each run executes, in a process of its own
CHILD = "\n".join((_HEAD, SERVER_CPU, _BODY))

PHASES = ("publish", "claim", "ack")


def run(checkout: str, extra: int, n: int, batch: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, DSN, str(extra), str(n), str(batch)],
        env={**os.environ, "PYTHONPATH": checkout},
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", default="0,30,62")
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkouts", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args()
    checkouts = args.checkouts.split(":")
    extras = [int(x) for x in args.extra.split(",")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for extra in extras:
            for checkout in checkouts:
                results.setdefault((checkout, extra), []).append(
                    run(checkout, extra, args.n, args.batch)
                )
    print(
        f"{args.n} messages, claims of {args.batch}, {args.rounds} rounds; server CPU per"
        " message, median [range] (ratio of medians to the first checkout)"
    )
    for extra in extras:
        print(f"  {extra} drained generations attached")
        base = results[(checkouts[0], extra)]
        for checkout in checkouts:
            rounds = results[(checkout, extra)]
            cells = []
            for phase in PHASES:
                values = [r[phase] for r in rounds]
                first = statistics.median(r[phase] for r in base)
                # too few messages to see a clock tick of CPU: no ratio
                ratio = statistics.median(values) / first if first else float("nan")
                cells.append(
                    f"{phase} {statistics.median(values):6.1f} us"
                    f" [{min(values):.0f}-{max(values):.0f}] ({ratio:.2f}x)"
                )
            print(f"    {checkout:24} " + "   ".join(cells))


if __name__ == "__main__":
    main()
