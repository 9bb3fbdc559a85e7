"""A rolling deploy across a migration, with real processes of the previous version.

    python benchmarks/probes/rolling_upgrade.py [--rev REV] [--dsn DSN] [--seconds S]

The previous version's package is taken from git (``--rev``; default: the commit before
the one that added the newest migration) into a temporary directory, and runs in
processes of its own (``PYTHONPATH``): it migrates a fresh schema to its newest version,
then a publisher and a consumer of that version start, the consumer rotating the storage
every 0.2 s. While they run, this checkout's ``migrate`` brings the schema to the newest
version, and a publisher and a consumer of this checkout join them. Every consumer writes
what it got to a ledger table before it acks. At the end: what each version published and
consumed, before and after the migration; lost and duplicated messages; errors in the
previous version's processes; the generations and eras left. Exit status 0 when nothing
is lost or duplicated, the previous version's consumer got messages after the migration,
and no process failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "probe_rolling"
QUEUE = "rolling"

#: a process of either version: ROLE is "publish" or "consume"; it runs until STOP exists
PROCESS = r"""
import os, sys, time
from pathlib import Path
import psycopg
from kombu import Connection, Consumer, Producer, Queue
import kombu_pgqueue
from kombu_pgqueue.embedded import broker_url

dsn, schema, queue, role, who, stop = sys.argv[1:7]
options = {"schema": schema, "rotate_interval": 0.2, "generation_max_age": 0,
           "polling_interval": 0.2, "pool_max_size": 2}
if role == "migrate":
    kombu_pgqueue.migrate(dsn, schema)
    sys.exit(0)
conn = Connection(broker_url(dsn), transport_options=options)
ledger = psycopg.connect(dsn, autocommit=True)
if role == "publish":
    first = int(sys.argv[7])
    producer = Producer(conn)
    i = first
    while not Path(stop).exists():
        producer.publish({"i": i, "by": who}, routing_key=queue)
        ledger.execute(
            f'INSERT INTO "{schema}_ledger".sent (i, by) VALUES (%s, %s)', (i, who))
        i += 1
        time.sleep(0.005)
else:
    def on_message(body, message):
        ledger.execute(
            f'INSERT INTO "{schema}_ledger".got (i, by) VALUES (%s, %s)', (body["i"], who))
        message.ack()
    with Consumer(conn, [Queue(queue)], callbacks=[on_message], prefetch_count=10):
        while not Path(stop).exists():
            try:
                conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
conn.release()
"""


def previous_rev() -> str:
    """The commit before the one that added the newest migration."""
    newest = sorted((ROOT / "kombu_pgqueue" / "sql" / "migrations").glob("0*.sql"))[-1]
    added = subprocess.run(
        ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--", str(newest)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    return added + "^"


def extract(rev: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kombu_pgqueue"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rev", help="the previous version (default: see the docstring)")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGQUEUE_TEST_DSN") or "host=127.0.0.1 dbname=test user=postgres",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase (10)")
    args = parser.parse_args()
    rev = args.rev or previous_rev()
    work = Path(tempfile.mkdtemp(prefix="pgqueue-rolling-"))
    old_path = work / "previous"
    old_path.mkdir()
    extract(rev, old_path)
    script = work / "process.py"
    script.write_text(PROCESS)
    stop = work / "stop"

    with psycopg.connect(args.dsn, autocommit=True) as db:
        for name in (SCHEMA, SCHEMA + "_ledger"):
            db.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        db.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA + "_ledger")))
        for table in ("sent", "got"):
            db.execute(
                sql.SQL("CREATE TABLE {} (i int, by text, at timestamptz DEFAULT now())").format(
                    sql.Identifier(SCHEMA + "_ledger", table)
                )
            )

        def spawn(version: str, role: str, who: str, *extra: str) -> subprocess.Popen[bytes]:
            env = dict(os.environ)
            if version == "previous":
                # the previous package first; the installed one (this checkout) is shadowed
                env["PYTHONPATH"] = str(old_path)
            command = [sys.executable, str(script), args.dsn, SCHEMA, QUEUE, role, who, str(stop)]
            return subprocess.Popen(
                command + list(extra),
                env=env,
                cwd=work,
                stderr=open(work / f"{who}.err", "wb"),  # noqa: SIM115
            )

        def version_of(db: psycopg.Connection) -> int:
            from kombu_pgqueue.migrations import current_version

            return current_version(db, SCHEMA)

        short = ["git", "-C", str(ROOT), "rev-parse", "--short", rev]
        print(f"previous version: {rev} ({subprocess.check_output(short, text=True).strip()})")
        assert spawn("previous", "migrate", "migrate-old").wait() == 0, "the previous migrate"
        before = version_of(db)
        procs = [
            spawn("previous", "publish", "old-publisher", "0"),
            spawn("previous", "consume", "old-consumer"),
        ]
        time.sleep(args.seconds)
        migrated_at = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        t0 = time.monotonic()
        from kombu_pgqueue import migrate

        migrate(args.dsn, SCHEMA)
        took = time.monotonic() - t0
        after = version_of(db)
        procs += [
            spawn("new", "publish", "new-publisher", "1000000"),
            spawn("new", "consume", "new-consumer"),
        ]
        time.sleep(args.seconds)
        stop.touch()
        codes = {p.args[6]: p.wait(timeout=60) for p in procs}  # type: ignore[index]
        # what is left waiting, drained by a consumer of this checkout
        stop.unlink()
        drainer = spawn("new", "consume", "new-drainer")

        def rows(query: str, *params: object) -> list[tuple[object, ...]]:
            return db.execute(query.replace("L.", f'"{SCHEMA}_ledger".'), params).fetchall()

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ((sent, got),) = rows(
                "SELECT (SELECT count(*) FROM L.sent), count(DISTINCT i) FROM L.got"
            )
            if int(got) >= int(sent):  # type: ignore[call-overload]
                break
            time.sleep(0.5)
        stop.touch()
        codes["new-drainer"] = drainer.wait(timeout=60)

        print(f"schema version {before} -> {after}; migrate took {took:.2f} s with both running")
        for by, n, after_n in rows(
            "SELECT by, count(*), count(*) FILTER (WHERE at > %s) FROM L.sent"
            " GROUP BY by ORDER BY by",
            migrated_at,
        ):
            print(f"  {by}: published {n} ({after_n} after the migration)")
        for by, n, after_n in rows(
            "SELECT by, count(*), count(*) FILTER (WHERE at > %s) FROM L.got"
            " GROUP BY by ORDER BY by",
            migrated_at,
        ):
            print(f"  {by}: consumed {n} ({after_n} after the migration)")
        ((lost,),) = rows(
            "SELECT count(*) FROM L.sent AS s"
            " WHERE NOT EXISTS (SELECT FROM L.got AS g WHERE g.i = s.i)"
        )
        ((dups,),) = rows(
            "SELECT count(*) FROM (SELECT i FROM L.got GROUP BY i HAVING count(*) > 1) AS d"
        )
        ((old_after,),) = rows(
            "SELECT count(*) FROM L.got WHERE by = 'old-consumer' AND at > %s", migrated_at
        )
        gens = db.execute(
            "SELECT p.level, p.relid::regclass::text FROM pg_partition_tree(%s) AS p"
            " WHERE p.level > 0 ORDER BY 2",
            (f'"{SCHEMA}".message_store',),
        ).fetchall()
        print(
            f"lost {lost}, duplicated {dups};"
            f" the previous consumer got {old_after} after the migration"
        )
        print("exit codes: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
        for who in codes:
            err = (work / f"{who}.err").read_text().strip()
            if err:
                print(f"--- {who} stderr (last 1500 characters):\n{err[-1500:]}")
        print("storage now: " + ", ".join(f"{name} (level {level})" for level, name in gens))
        ok = lost == 0 and dups == 0 and old_after > 0 and not any(codes.values())
        print("PASS" if ok else "FAIL")
        for name in (SCHEMA, SCHEMA + "_ledger"):
            db.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
