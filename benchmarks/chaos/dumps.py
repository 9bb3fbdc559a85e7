"""Scenario dumps: a real ``pg_dump -Fc`` of the broker's schema, back to back, while
producers and consumers keep a busy queue flowing and the storage rotates every few
seconds (VACUUM every ``vacuum_every`` s). Every dump must succeed, and hold each
message of a queue no one consumes (KEPT, moved between generations by the rotation
meanwhile) exactly once; a sample of the dumps is restored into a new database, where a
consumer gets KEPT's messages once, new publishes are delivered, and the rotation goes
on with its bookkeeping agreeing with the tables (tests/backups.py).
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psycopg
from kombu import Connection, Producer, Queue
from psycopg import sql

from kombu_pgqueue._rotation import rotate
from kombu_pgqueue.embedded import broker_url

from . import procs
from .context import Context, Result
from .kombu_scenarios import QUEUE, _drain_results, consumer, producer

# the dump helpers (and new_database) live with the tests, which use them too; the chaos
# suite borrows them
sys.path.insert(0, str(procs.ROOT / "tests"))
import backups  # noqa: E402
from helpers import new_database  # noqa: E402

#: the queue no one consumes: its messages must be in every dump, once
KEPT = "kept"
KEPT_MESSAGES = 200
#: the rotation as fast as it goes: a new generation every 2 s, a step every second
ROTATING = {"generation_max_age": 2.0, "rotate_interval": 1.0}
#: restore one dump in this many (and the first and the last)
RESTORE_EVERY = 200


def _kept_in_dump(tools: Path, path: Path, schema: str) -> Counter[str]:
    """The ids of KEPT's messages in the dump's message tables, with how often each is."""
    text = backups.run(tools / "pg_restore", "--data-only", "-f", "-", str(path)).stdout
    ids: Counter[str] = Counter()
    columns: list[str] | None = None
    for line in text.splitlines():
        if columns is None:
            if line.startswith(f"COPY {schema}.message_store_") or line.startswith(
                f'COPY "{schema}".message_store_'
            ):
                columns = [c.strip() for c in line.split("(", 1)[1].split(")", 1)[0].split(",")]
            continue
        if line == "\\.":
            columns = None
            continue
        row = dict(zip(columns, line.split("\t")))
        if row.get("queue") == KEPT:
            ids[row["id"]] += 1
    return ids


def _restore_check(dsn: str, path: Path, schema: str) -> str | None:
    """Restore ``path`` into a new database and use it as a broker; what went wrong."""
    with new_database(dsn, "chaos_restore") as restored:
        backups.restore(restored, path)
        with psycopg.connect(restored, autocommit=True) as db:
            # the broker's first connection puts the generation sequence back where a
            # restore left it ahead (pg_dump reads sequences outside its snapshot)
            conn = Connection(
                broker_url(restored),
                transport_options={"schema": schema, "batch_acks": False, **ROTATING},
            )
            conn.connect()
            conn.default_channel  # noqa: B018 - opens the pool: the repair runs
            try:
                wrong = backups.storage_disagreements(db, schema)
                if wrong:
                    return f"restored bookkeeping disagrees once a broker connected: {wrong}"
                kept = Queue(KEPT, channel=conn.default_channel)
                got = []
                while (message := kept.get(no_ack=False)) is not None:
                    got.append(message.payload["k"])
                    message.ack()
                if sorted(got) != list(range(KEPT_MESSAGES)):
                    return f"restored {KEPT!r} gave {len(got)} messages ({len(set(got))} distinct)"
                Producer(conn).publish({"k": "new"}, routing_key=KEPT)
                for _ in range(3):
                    rotate(conn.default_channel.store)
                message = kept.get(no_ack=False)
                if message is None or message.payload != {"k": "new"}:
                    return "a publish into the restored broker was not delivered"
                message.ack()
                wrong = backups.storage_disagreements(db, schema)
                if wrong:
                    return f"after rotations, the restored bookkeeping disagrees: {wrong}"
            finally:
                conn.release()
    return None


def dumps(ctx: Context, vacuum_every: float, rate: float) -> Result:
    minutes = ctx.minutes or (1.0 if ctx.quick else 10.0)
    n_prod = n_cons = 2
    mp = multiprocessing.get_context("spawn")
    with ctx.run("dumps") as run, run.connect() as conn:
        tools = backups.bindir(conn)
        setup = Connection(broker_url(ctx.dsn), transport_options={"schema": run.schema})
        setup.connect()
        Queue(KEPT, channel=setup.default_channel).declare()
        Queue(QUEUE, channel=setup.default_channel).declare()
        out = Producer(setup)
        for k in range(KEPT_MESSAGES):
            out.publish({"k": k}, routing_key=KEPT)
        setup.release()

        stop_prod, stop_cons = mp.Event(), mp.Event()
        results = mp.Queue()
        t0 = time.time()
        counters = [mp.Value("q", 0, lock=False) for _ in range(n_cons)]
        workers = [
            mp.Process(
                target=consumer,
                args=(ctx.dsn, run.schema, run.run_id, t0, stop_cons, results, c, False, ROTATING),
            )
            for c in counters
        ] + [
            mp.Process(
                target=producer,
                args=(ctx.dsn, run.schema, p, rate / n_prod, stop_prod, results, ROTATING),
            )
            for p in range(n_prod)
        ]
        vac_stop = threading.Event()
        taken = failed = restored = 0
        failures: Counter[str] = Counter()
        wrong_dumps: list[str] = []
        restore_failures: list[str] = []
        generations_seen: set[int] = set()
        work = Path(tempfile.mkdtemp(prefix="pgqueue-dumps-"))
        try:
            for p in workers:
                p.start()
            if vacuum_every:
                procs.vacuum_ticker(ctx.dsn, run.schema, vacuum_every, vac_stop)
            end = time.monotonic() + minutes * 60
            report = time.monotonic() + 30
            last: Path | None = None
            while time.monotonic() < end:
                path = work / f"dump-{taken % 2}.dump"
                done = subprocess.run(
                    [
                        str(tools / "pg_dump"),
                        "-Fc",
                        "-n",
                        run.schema,
                        "-f",
                        str(path),
                        "--dbname",
                        ctx.dsn,
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                taken += 1
                if done.returncode != 0:
                    failed += 1
                    failures[done.stderr.strip().splitlines()[-1][:160]] += 1
                    continue
                last = path
                ids = _kept_in_dump(tools, path, run.schema)
                if len(ids) != KEPT_MESSAGES or any(n != 1 for n in ids.values()):
                    wrong_dumps.append(
                        f"dump {taken}: {len(ids)} of {KEPT_MESSAGES} kept messages, "
                        f"{sum(n > 1 for n in ids.values())} more than once"
                    )
                if taken == 1 or taken % RESTORE_EVERY == 0:
                    restored += 1
                    if problem := _restore_check(ctx.dsn, path, run.schema):
                        restore_failures.append(f"dump {taken}: {problem}")
                row = conn.execute(
                    sql.SQL("SELECT last_value FROM {}").format(
                        sql.Identifier(run.schema, "generation_seq")
                    )
                ).fetchone()
                generations_seen.add(int(row[0]) if row else 0)
                if time.monotonic() > report:
                    report += 30
                    print(
                        f"    {run.elapsed():5.0f}s  dumps {taken}  failed {failed}"
                        f"  consumed {sum(c.value for c in counters)}"
                        f"  generation {max(generations_seen)}"
                    )
            if last is not None:
                restored += 1
                if problem := _restore_check(ctx.dsn, last, run.schema):
                    restore_failures.append(f"last dump: {problem}")
            stop_prod.set()
            reports = _drain_results(results, n_prod)
            stop_cons.set()
            reports += _drain_results(results, n_cons)
        finally:
            stop_prod.set()
            stop_cons.set()
            vac_stop.set()
            for p in workers:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        tables = backups.tables(conn, run.schema)
        spares = conn.execute(
            sql.SQL("SELECT kind, count(*) FROM {} GROUP BY 1 ORDER BY 1").format(
                sql.Identifier(run.schema, "spare")
            )
        ).fetchall()
        prods = [r for r in reports if r[0] == "producer"]
        published = sum(r[2] - len(r[3]) for r in prods)
        ok = failed == 0 and not wrong_dumps and not restore_failures and taken > 0
        result = Result("dumps", ok)
        result.measures += [
            ("duration (s) / publish rate (msg/s)", f"{minutes * 60:.0f} / {rate:.0f}"),
            ("rotation", f"a new generation every {ROTATING['generation_max_age']:.0f} s"),
            (
                "generations started during the dumps",
                len(generations_seen) and max(generations_seen) - min(generations_seen),
            ),
            (
                "published / consumed (busy queue)",
                f"{published} / {sum(c.value for c in counters)}",
            ),
            ("dumps taken", taken),
            ("dumps failed", failed),
            (f"dumps without each of {KEPT_MESSAGES} kept messages once", len(wrong_dumps)),
            ("dumps restored and run as a broker", restored),
            ("restores that failed their check", len(restore_failures)),
            ("tables of the schema at the end / spares", f"{len(tables)} / {dict(spares)}"),
        ]
        result.notes += [f"{n} x {text}" for text, n in failures.most_common(5)]
        result.notes += wrong_dumps[:5] + restore_failures[:5]
        return result
