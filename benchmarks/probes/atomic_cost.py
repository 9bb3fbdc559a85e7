"""Where an atomic task's drain spends the machine's CPU, per task, against plain tasks.

    python benchmarks/probes/atomic_cost.py [--pool prefork|threads] [-c N] [--n N]
                                            [--rounds R] [--kinds plain,plaintx,atomic]
                                            [--py-spy DIR]

The tasks of benchmarks/atomic_drain.py (one row written: ``plain`` in autocommit,
``plaintx`` in a transaction of its own, ``atomic`` as an AtomicTask), N of a kind
loaded with ``send_many`` and drained by one worker; the kinds alternate for R rounds.
Between the 1,000th and the (N-1,000)th row written it reads (/proc/PID/stat, user +
system) the CPU time of the worker's main process, its pool children and the
PostgreSQL backends the worker opened (found by application_name: the task's
connections by PGAPPNAME, the broker's as ``pgqueue[pid]``), and prints tasks/s and
CPU microseconds per task of each, and the wall time per task. ``--py-spy DIR`` also
records the worker (with its children) under ``py-spy record`` into DIR/<kind>.txt
(collapsed stacks; needs ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

import psycopg
from psycopg import sql

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.atomic_drain import TABLE, make_app  # noqa: E402 - after sys.path

DSN = os.environ.get("PGQUEUE_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
URL = "pgqueue://postgres@127.0.0.1:5432/test"
SCHEMA = "probe_atomic"
APPNAME = "atomic_probe"
MARGIN = 1000
TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def backends(conn: psycopg.Connection, pids: list[int]) -> list[int]:
    names = [APPNAME] + [f"pgqueue[{p}]" for p in pids]
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = ANY(%s)", (names,)
    ).fetchall()
    return [r[0] for r in rows]


def snapshot(conn: psycopg.Connection, main: int) -> dict[str, float]:
    kids = children(main)
    return {
        "main": cpu(main),
        "children": sum(cpu(p) for p in kids),
        "server": sum(cpu(p) for p in backends(conn, [main, *kids])),
        "wall": time.monotonic(),
    }


def drain(conn: psycopg.Connection, kind: str, pool: str, conc: int, n: int, spy: str | None):
    queue = f"{SCHEMA}_{kind}_{pool}"
    tag = f"{kind}_{pool}"
    options = {"schema": SCHEMA}
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE kind = %s").format(sql.Identifier(SCHEMA, TABLE)), (tag,)
    )
    app = make_app(URL, options, queue, DSN, SCHEMA)
    from celery_pgqueue.bulk import send_many

    try:
        send_many(
            app,
            [
                app.signature(f"bench.write_{kind}", (tag,), task_id=str(uuid.uuid4()))
                for _ in range(n)
            ],
        )
    finally:
        app.close()
    env = {
        **os.environ,
        "BENCH_BROKER_URL": URL,
        "BENCH_TRANSPORT_OPTIONS": json.dumps({"schema": SCHEMA}),
        "BENCH_QUEUE": queue,
        "ATOMIC_BENCH_DSN": DSN,
        "ATOMIC_BENCH_SCHEMA": SCHEMA,
        "PGAPPNAME": APPNAME,
    }
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "benchmarks.atomic_drain",
        "worker",
        "--pool",
        pool,
        "-c",
        str(conc),
        "--without-mingle",
        "--without-gossip",
        "-l",
        "WARNING",
        "-n",
        f"{queue}@%h",
    ]
    worker = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    spy_proc = None
    count = sql.SQL("SELECT count(*) FROM {} WHERE kind = %s").format(sql.Identifier(SCHEMA, TABLE))
    try:
        marks: list[dict[str, float]] = []
        for target in (MARGIN, n - MARGIN):
            while (conn.execute(count, (tag,)).fetchone() or (0,))[0] < target:
                if worker.poll() is not None:
                    raise RuntimeError(f"worker exited ({worker.returncode})")
                time.sleep(0.005)
            marks.append(snapshot(conn, worker.pid))
            if spy and spy_proc is None:
                spy_proc = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(worker.pid),
                        "--subprocesses",
                        "--format",
                        "raw",
                        "--rate",
                        "200",
                        "-o",
                        os.path.join(spy, f"{tag}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        done = n - 2 * MARGIN
        a, b = marks
        out = {k: (b[k] - a[k]) / done * 1e6 for k in ("main", "children", "server", "wall")}
        out["rate"] = 1e6 / out["wall"]
        return out
    finally:
        if spy_proc is not None:
            spy_proc.send_signal(signal.SIGINT)
            spy_proc.wait(30)
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", default="prefork")
    p.add_argument("-c", type=int, default=None)
    p.add_argument("--n", type=int, default=6000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="plain,plaintx,atomic")
    p.add_argument("--py-spy", dest="spy", default=None)
    args = p.parse_args()
    conc = args.c or (2 if args.pool == "prefork" else 8)
    kinds = args.kinds.split(",")
    if args.spy:
        os.makedirs(args.spy, exist_ok=True)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        from kombu_pgqueue import migrate

        migrate(DSN, SCHEMA)
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (kind text NOT NULL, task_id text NOT NULL, at float8 NOT NULL)"
            ).format(sql.Identifier(SCHEMA, TABLE))
        )
        results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                res = drain(conn, kind, args.pool, conc, args.n, args.spy)
                results[kind].append(res)
                print(
                    f"round {r + 1} {kind:8s} " + " ".join(f"{k}={v:.0f}" for k, v in res.items()),
                    flush=True,
                )
        print(
            f"\n{args.pool} -c {conc}, N={args.n}, medians [min-max] over {args.rounds} rounds;"
            " CPU and wall in us per task"
        )
        keys = ("rate", "wall", "main", "children", "server")
        print(f"{'kind':8s} " + " ".join(f"{k:>20s}" for k in keys))
        for kind in kinds:
            cells = []
            for k in keys:
                vals = [res[k] for res in results[kind]]
                cells.append(f"{statistics.median(vals):.0f} [{min(vals):.0f}-{max(vals):.0f}]")
            print(f"{kind:8s} " + " ".join(f"{c:>20s}" for c in cells))
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))


if __name__ == "__main__":
    main()
