"""Storage that rotates, tried before it is built (issue 30): one table against
generations (range partitions) that are emptied by TRUNCATE, under a held snapshot.

    python benchmarks/probes/rotation.py [--modes single,generations] [--rounds 1]
        [--before 30] [--hold 120] [--after 60] [--hold-kind dump|snapshot]
        [--rotate-every 10]

Both storages run the same minimal broker, written here in SQL shaped as
kombu_pgqueue's statements are (a claim of 20 by ``FOR UPDATE SKIP LOCKED`` that leases
them, an ack that deletes them by id and lease, publishes in batches): 4 consumer
processes, a producer that keeps 2,000 to 6,000 messages waiting, ``VACUUM`` every 10 s,
and a priority-9 message every 5 s. After ``--before`` seconds another session holds a
snapshot for ``--hold`` seconds, as pg_dump does ('dump': ACCESS SHARE on every table
of the schema) or reading none of them ('snapshot'). Printed per mode: drain per
``--hold``/N minute against before, the slowest priority-9 delivery during the hold, and
the schema's size before, when the hold ends and ``--after`` seconds later.

generations: messages carry ``gen``; publishes go to the current generation. Every
``--rotate-every`` seconds one process (the rotator, here a thread of its own; in the
product a consumer under an advisory lock) attaches the next generation (CREATE TABLE,
then ATTACH PARTITION, which takes only SHARE UPDATE EXCLUSIVE on the parent), moves
what is left ready or expired in generations two behind forward, advances the oldest
live generation (claims read ``gen >= oldest``, so the partitions before it are pruned
at execution), and empties generations before it with TRUNCATE under a 20 ms
lock_timeout, skipping a partition another session holds ACCESS SHARE on (pg_dump): its
space comes back when that session ends. Emptied partitions are detached and dropped
when nothing holds them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import statistics
import threading
import time
from typing import Any

import psycopg
from psycopg import errors, sql

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")
QUEUE = "q"
BODY = b'{"task": "t", "args": [1, 2], "kwargs": {}}' * 4


def setup(schema: str, mode: str) -> None:
    s = sql.Identifier(schema)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
        columns = sql.SQL(
            "queue text NOT NULL, priority smallint NOT NULL DEFAULT 0,"
            " next_iteration timestamptz NOT NULL DEFAULT now(), lease bigint,"
            " attempts integer NOT NULL DEFAULT 0, published float8 NOT NULL, body bytea NOT NULL"
        )
        if mode == "single":
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.m (id bigserial PRIMARY KEY, {})"
                    " WITH (fillfactor = 50, autovacuum_enabled = off)"
                ).format(s, columns)
            )
        else:
            conn.execute(sql.SQL("CREATE SEQUENCE {}.m_id").format(s))
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {s}.m (gen integer NOT NULL,"
                    " id bigint NOT NULL DEFAULT nextval('{raw}.m_id'), {c},"
                    " PRIMARY KEY (id, gen)) PARTITION BY RANGE (gen)"
                ).format(s=s, raw=sql.SQL(schema), c=columns)
            )
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {}.state (single boolean PRIMARY KEY DEFAULT true,"
                    " current integer NOT NULL, oldest integer NOT NULL)"
                ).format(s)
            )
            conn.execute(sql.SQL("INSERT INTO {}.state VALUES (true, 0, 0)").format(s))
        conn.execute(sql.SQL("CREATE INDEX m_ready ON {}.m (queue, priority DESC, id)").format(s))
        if mode == "generations":
            for gen in (0, 1):
                attach(conn, schema, gen)


def attach(conn: psycopg.Connection, schema: str, gen: int) -> None:
    part = sql.Identifier(schema, f"m_{gen}")
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (LIKE {}.m INCLUDING DEFAULTS)"
            " WITH (fillfactor = 50, autovacuum_enabled = off)"
        ).format(part, sql.Identifier(schema))
    )
    conn.execute(
        sql.SQL("ALTER TABLE {}.m ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
            sql.Identifier(schema), part, sql.Literal(gen), sql.Literal(gen + 1)
        )
    )


def statements(schema: str, mode: str) -> dict[str, sql.Composed]:
    gens = mode == "generations"
    live = sql.SQL("gen >= (SELECT oldest FROM {}.state) AND").format(sql.Identifier(schema))
    f = {
        "s": sql.Identifier(schema),
        "live": live if gens else sql.SQL(""),
        "gen_col": sql.SQL("gen, ") if gens else sql.SQL(""),
        "gen_val": sql.SQL("(SELECT current FROM {}.state), ").format(sql.Identifier(schema))
        if gens
        else sql.SQL(""),
        "same_gen": sql.SQL("AND m.gen = c.gen") if gens else sql.SQL(""),
        "c_gen": sql.SQL(", gen") if gens else sql.SQL(""),
    }
    return {
        "publish": sql.SQL(
            "INSERT INTO {s}.m ({gen_col}queue, priority, published, body)"
            " SELECT {gen_val}%(queue)s, p, %(now)s, %(body)s"
            " FROM unnest(%(priorities)s::int[]) AS p"
        ).format(**f),
        "claim": sql.SQL(
            "WITH c AS MATERIALIZED ("
            " SELECT id{c_gen} FROM {s}.m WHERE {live} queue = %(queue)s"
            " AND next_iteration <= now() ORDER BY priority DESC, id LIMIT 20"
            " FOR UPDATE SKIP LOCKED)"
            " UPDATE {s}.m AS m SET next_iteration = now() + interval '60 s',"
            " attempts = m.attempts + 1, lease = %(lease)s"
            " FROM c WHERE m.id = c.id {same_gen} AND m.id = ANY(ARRAY(SELECT id FROM c))"
            " RETURNING m.id, m.priority, m.published"
        ).format(**f),
        "ack": sql.SQL(
            "DELETE FROM {s}.m WHERE {live} id = ANY(%(ids)s) AND lease = %(lease)s"
        ).format(**f),
    }


def consumer(schema: str, mode: str, stop: Any, counter: Any, probes: Any) -> None:
    q = statements(schema, mode)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        while not stop.is_set():
            lease = secrets.randbits(62)
            rows = conn.execute(q["claim"], {"queue": QUEUE, "lease": lease}).fetchall()
            if not rows:
                stop.wait(0.01)
                continue
            now = time.time()
            for _, priority, published in rows:
                if priority == 9:
                    probes.put((published, now - published))
            ids = [row[0] for row in rows]
            for _ in range(5):  # a row moved to another generation meanwhile: again
                try:
                    conn.execute(q["ack"], {"ids": ids, "lease": lease})
                    break
                except errors.SerializationFailure:
                    continue
            counter.value += len(rows)


def producer(schema: str, mode: str, stop: Any, counters: list[Any]) -> None:
    q = statements(schema, mode)
    sent = 0
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        while not stop.is_set():
            backlog = sent - sum(c.value for c in counters)
            if backlog < 6000:
                n = min(1000, 6000 - backlog)
                params = {"queue": QUEUE, "now": time.time(), "body": BODY, "priorities": [0] * n}
                conn.execute(q["publish"], params)
                sent += n
            else:
                stop.wait(0.01)


def prober(schema: str, mode: str, stop: threading.Event) -> None:
    q = statements(schema, mode)
    with psycopg.connect(DSN, autocommit=True) as conn:
        while not stop.wait(5.0):
            params = {"queue": QUEUE, "now": time.time(), "body": BODY, "priorities": [9]}
            conn.execute(q["publish"], params)


def vacuumer(schema: str, stop: threading.Event) -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        while not stop.wait(10.0):
            conn.execute(sql.SQL("VACUUM {}.m").format(sql.Identifier(schema)))


class Rotator:
    """The rotation, as a consumer would run it under an advisory lock."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.s = sql.Identifier(schema)
        self.conn = psycopg.connect(DSN, autocommit=True)
        self.conn.execute("SET lock_timeout = '20ms'")
        #: partitions before the oldest live generation, not yet emptied
        self.waiting: dict[int, str] = {}
        self.events: list[str] = []

    def state(self) -> tuple[int, int]:
        row = self.conn.execute(sql.SQL("SELECT current, oldest FROM {}.state").format(self.s))
        current, oldest = row.fetchone()  # type: ignore[misc]
        return current, oldest

    def rotate(self) -> None:
        current, oldest = self.state()
        try:  # the generation after next, so that publishes never wait for DDL
            attach(self.conn, self.schema, current + 2)
        except (errors.LockNotAvailable, errors.DuplicateTable) as exc:
            self.events.append(f"attach {current + 2}: {type(exc).__name__}")
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.Identifier(self.schema, f"m_{current + 2}")))  # fmt: skip
        self.conn.execute(sql.SQL("UPDATE {}.state SET current = %s").format(self.s), [current + 1])
        for gen in range(oldest, current):  # two behind the new current one: move forward
            part = sql.Identifier(self.schema, f"m_{gen}")
            self.conn.execute(
                sql.SQL(
                    "UPDATE {s}.m SET gen = %(to)s WHERE gen = %(gen)s AND id IN ("
                    " SELECT id FROM {p} WHERE lease IS NULL OR next_iteration <= now()"
                    " FOR UPDATE SKIP LOCKED)"
                ).format(s=self.s, p=part),
                {"to": current + 1, "gen": gen},
            )
        new_oldest = oldest
        while new_oldest <= current:
            part = sql.Identifier(self.schema, f"m_{new_oldest}")
            if self.conn.execute(
                sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(part)
            ).fetchone()[0]:  # type: ignore[index]  # noqa: E501
                break
            self.waiting[new_oldest] = "empty"
            new_oldest += 1
        if new_oldest != oldest:
            self.conn.execute(
                sql.SQL("UPDATE {}.state SET oldest = %s").format(self.s), [new_oldest]
            )
        self.reclaim()

    def reclaim(self) -> None:
        for gen, what in sorted(self.waiting.items()):
            part = sql.Identifier(self.schema, f"m_{gen}")
            regclass = f'"{self.schema}".m_{gen}'
            held = self.conn.execute(
                "SELECT pid FROM pg_locks WHERE relation = %s::regclass AND granted"
                " AND mode = 'AccessShareLock' AND pid <> pg_backend_pid() LIMIT 1",
                [regclass],
            ).fetchone()
            if held:
                continue  # a reader (pg_dump) holds it: later
            try:
                if what == "empty":
                    self.conn.execute(sql.SQL("TRUNCATE {}").format(part))
                    self.waiting[gen] = "truncated"
                else:
                    self.conn.execute(
                        sql.SQL("ALTER TABLE {}.m DETACH PARTITION {}").format(self.s, part)
                    )
                    self.conn.execute(sql.SQL("DROP TABLE {}").format(part))
                    del self.waiting[gen]
            except errors.LockNotAvailable:
                self.events.append(f"{what} {gen}: lock not available")


def rotator(schema: str, stop: threading.Event, every: float, out: list[Rotator]) -> None:
    rot = Rotator(schema)
    out.append(rot)
    while not stop.wait(every):
        try:
            rot.rotate()
        except psycopg.Error as exc:
            rot.events.append(f"rotate: {type(exc).__name__}: {exc}")


def size(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class AS c"
        " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind = 'r'",
        [schema],
    ).fetchone()
    return int(row[0]) if row else 0


def hold(holder: psycopg.Connection, schema: str, kind: str) -> None:
    holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    holder.execute("SELECT count(*) FROM pg_class").fetchone()
    if kind == "dump":
        for (table,) in holder.execute(
            "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            [schema],
        ).fetchall():
            holder.execute(
                sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(sql.Identifier(schema, table))
            )


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    schema = f"probe_rot_{mode}"
    setup(schema, mode)
    mp = multiprocessing.get_context("spawn")
    stop = mp.Event()
    counters = [mp.Value("q", 0, lock=False) for _ in range(4)]
    probes = mp.Queue()
    procs = [mp.Process(target=consumer, args=(schema, mode, stop, c, probes)) for c in counters]
    procs.append(mp.Process(target=producer, args=(schema, mode, stop, counters)))
    halt = threading.Event()
    rotators: list[Rotator] = []
    threads = [
        threading.Thread(target=prober, args=(schema, mode, halt)),
        threading.Thread(target=vacuumer, args=(schema, halt)),
    ]
    if mode == "generations":
        threads.append(
            threading.Thread(target=rotator, args=(schema, halt, args.rotate_every, rotators))
        )
    samples: list[tuple[float, int]] = []
    marks: dict[str, float] = {}
    sizes: dict[str, int] = {}
    with psycopg.connect(DSN, autocommit=True) as conn, psycopg.connect(DSN) as holder:
        for p in procs:
            p.start()
        for t in threads:
            t.start()

        def sample(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                samples.append((time.monotonic(), sum(c.value for c in counters)))
                time.sleep(1.0)

        marks["before"] = time.monotonic()
        sample(args.before)
        sizes["before"] = size(conn, schema)
        hold(holder, schema, args.hold_kind)
        marks["during"], wall_during = time.monotonic(), time.time()
        sample(args.hold)
        sizes["hold ends"] = size(conn, schema)
        if rotators:
            current, oldest = rotators[0].state()
            rotators[0].events.append(f"hold ends: generations {oldest}..{current} live")
        holder.rollback()
        marks["after"], wall_after = time.monotonic(), time.time()
        sample(args.after)
        sizes["after"] = size(conn, schema)
        stop.set()
        halt.set()
        for p in procs:
            p.join(30)
        for t in threads:
            t.join(30)
    latencies = []
    while not probes.empty():
        latencies.append(probes.get())

    def rate(a: float, b: float) -> float:
        inside = [(t, v) for t, v in samples if a <= t <= b]
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    before = rate(marks["before"] + 5, marks["during"])
    step = args.hold / args.windows
    windows = [
        rate(marks["during"] + k * step, marks["during"] + (k + 1) * step)
        for k in range(args.windows)
    ]
    during = [lat for at, lat in latencies if wall_during <= at <= wall_after]
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {
        "mode": mode,
        "before": before,
        "windows": windows,
        "after": rate(marks["after"], marks["after"] + args.after),
        "probe_max": max(during) if during else float("nan"),
        "probe_p50": statistics.median(during) if during else float("nan"),
        "sizes": sizes,
        "events": rotators[0].events[-5:] if rotators else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="single,generations")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", type=float, default=30)
    parser.add_argument("--hold", type=float, default=120)
    parser.add_argument("--windows", type=int, default=4, help="parts of the hold reported")
    parser.add_argument("--after", type=float, default=60)
    parser.add_argument("--hold-kind", choices=("dump", "snapshot"), default="dump")
    parser.add_argument("--rotate-every", type=float, default=10.0)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {vars(args)}")
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            res = run(mode, args)
            mb = {k: round(v / 1e6) for k, v in res["sizes"].items()}
            print(
                f"round {r + 1} {mode:11} before {res['before']:7.0f}/s  hold "
                + " ".join(f"{w / res['before']:.2f}" for w in res["windows"])
                + f"  after {res['after'] / res['before']:.2f}"
                + f"  probe p50/max {res['probe_p50']:.2f}/{res['probe_max']:.2f} s"
                + f"  MB {mb}  load {os.getloadavg()[0]:.1f}"
            )
            for event in res["events"]:
                print(f"    {event}")


if __name__ == "__main__":
    main()
