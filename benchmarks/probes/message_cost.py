"""What one message costs the server: CPU and WAL bytes for its publish, claim and ack
(issue 30 asks for them before and after the storage changed).

    python benchmarks/probes/message_cost.py [--n 20000] [--batch 100] [--rounds 3]
        [--checkouts /tmp/before:/work/main] [--aged no|yes|both]

For each checkout (a directory holding kombu_pgqueue, run in a subprocess with it first on
sys.path), in rounds that interleave the checkouts: a fresh schema, ``--n`` publishes one
by one, claims of ``--batch`` until the queue is empty, and acks of each claimed batch.
The server's CPU is the user and system time of every process of the PostgreSQL server
(its postmaster's children, read from /proc), so the machine should be otherwise quiet;
WAL is ``pg_current_wal_lsn()`` before and after each phase. Printed per checkout: the
median and range over the rounds, per message, for each phase. ``--aged yes`` rotates the
new schema's storage three times first, so that the messages go to a generation in an era
(migration 0014) as in an installation that has run for a while; ``both`` interleaves the
two in each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")

#: the child's server_cpu(conn): the CPU seconds of every process of the PostgreSQL
#: server so far (its postmaster and the postmaster's children, from /proc); the child
#: defines ``ticks`` (also used by generation_cost.py)
SERVER_CPU = r"""
def server_cpu(conn):
    # every process whose parent is the postmaster, and the postmaster
    root = int(open(conn.execute("SHOW data_directory").fetchone()[0] + "/postmaster.pid")
               .readline())
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == root or int(fields[1]) == root:
            total += int(fields[11]) + int(fields[12])
    return total / ticks
"""

CHILD = (
    r"""
import json, os, sys, uuid
import psycopg
from psycopg import sql
from kombu_pgqueue import migrate
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._rotation import rotate
from kombu_pgqueue._store import Outgoing, Store, new_lease

dsn, n, batch, aged = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
schema = "cost_" + uuid.uuid4().hex[:8]
ticks = os.sysconf("SC_CLK_TCK")


"""
    + SERVER_CPU
    + r"""

def wal(conn):
    return int(conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()[0])


with psycopg.connect(dsn, autocommit=True) as conn:
    migrate(conn, schema)
    if aged:
        rotating = Store(dsn, parse_options({"schema": schema, "generation_max_age": 0}))
        for _ in range(3):
            rotate(rotating)
        rotating.pool.close()
    store = Store(dsn, parse_options({"schema": schema}))
    out = {}
    message = Outgoing(queue="q", body=b'{"task": "t", "args": [1, 2]}', headers="{}",
                       properties="{}")
    store.publish(message)  # connections and prepared statements warm
    store.ack_many([d.id for d in store.claim("q", 1, 1)], [1])

    c0, w0 = server_cpu(conn), wal(conn)
    for _ in range(n):
        store.publish(message)
    c1, w1 = server_cpu(conn), wal(conn)
    claimed = []
    while True:
        lease = new_lease()
        got = store.claim("q", batch, lease)
        if not got:
            break
        claimed.append(([d.id for d in got], lease))
    c2, w2 = server_cpu(conn), wal(conn)
    for ids, lease in claimed:
        store.ack_many(ids, [lease] * len(ids))
    c3, w3 = server_cpu(conn), wal(conn)
    assert sum(len(ids) for ids, _ in claimed) == n, "every message claimed once"
    out = {
        "publish": [(c1 - c0) / n * 1e6, (w1 - w0) / n],
        "claim": [(c2 - c1) / n * 1e6, (w2 - w1) / n],
        "ack": [(c3 - c2) / n * 1e6, (w3 - w2) / n],
    }
    store.pool.close()
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
print(json.dumps(out))
"""
)


def run(checkout: str, n: int, batch: int, aged: bool) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": checkout}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, DSN, str(n), str(batch), "1" if aged else "0"],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkouts", default=str(Path(__file__).resolve().parents[2]))
    parser.add_argument("--aged", choices=("no", "yes", "both"), default="no")
    args = parser.parse_args()
    checkouts = args.checkouts.split(":")
    ages = {"no": [False], "yes": [True], "both": [False, True]}[args.aged]
    sides = [(checkout, aged) for checkout in checkouts for aged in ages]
    results: dict[tuple[str, bool], list[dict[str, list[float]]]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for checkout, aged in sides:
            results[(checkout, aged)].append(run(checkout, args.n, args.batch, aged))
    print(f"{args.n} messages, claims of {args.batch}, {args.rounds} rounds; per message:")
    for (checkout, aged), rounds in results.items():
        print(f"  {checkout}{' (aged: three rotations first)' if aged else ''}")
        for phase in ("publish", "claim", "ack"):
            cpu = [r[phase][0] for r in rounds]
            wal = [r[phase][1] for r in rounds]
            print(
                f"    {phase:8} server CPU {statistics.median(cpu):7.1f} us"
                f" [{min(cpu):.1f}-{max(cpu):.1f}]   WAL {statistics.median(wal):7.0f} B"
                f" [{min(wal):.0f}-{max(wal):.0f}]"
            )


if __name__ == "__main__":
    main()
