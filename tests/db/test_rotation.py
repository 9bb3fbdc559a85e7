"""Storage that rotates (migrations 0012, 0016): messages live in generations, and one that
holds nothing live is emptied by TRUNCATE once no snapshot that may see its rows is held;
one that a reader holds a lock on (pg_dump) is left, without a wait in front of the
claims, until that reader ends. An emptied generation's table is kept and reused, never
dropped. A message that would keep an old generation alive moves forward, and dedup keys
hold across generations.

Each rotation here is one round, ``_rotation.rotate`` (what a consumer's rotation thread
runs every ``rotate_interval``), with ``generation_max_age=0`` so that every round starts a
new generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import plans
import psycopg
import pytest
from helpers import drain
from kombu import Connection, Consumer, Producer, Queue
from psycopg import sql
from waiting import wait_for

from celery_pgqueue.cli import storage_waits
from celery_pgqueue.metrics import PgQueueCollector
from kombu_pgqueue import migrate
from kombu_pgqueue._rotation import READER_HOLD_SECONDS, STEP_LOCK_TIMEOUT, rotate
from kombu_pgqueue.admin import Monitor

QUEUE = "rot"


@pytest.fixture
def rotating(make_connection: Callable[..., Connection]) -> Connection:
    conn = make_connection(generation_max_age=0)
    Queue(QUEUE, channel=conn.default_channel).declare()
    return conn


@pytest.fixture
def holder(dsn: str) -> Iterator[psycopg.Connection]:
    """Another session, as pg_dump or an analyst's query would be."""
    with psycopg.connect(dsn) as conn:
        yield conn


def _store(conn: Connection) -> Any:
    return conn.default_channel.store


def _generations(db: psycopg.Connection, schema: str) -> dict[int, str]:
    rows = db.execute(
        sql.SQL("SELECT gen, state FROM {} ORDER BY gen").format(
            sql.Identifier(schema, "generation")
        )
    ).fetchall()
    return dict(rows)


def _partition_exists(db: psycopg.Connection, schema: str, gen: int) -> bool:
    row = db.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".message_store_{gen}',))
    return bool(row.fetchone()[0])  # type: ignore[index]


def _spares(db: psycopg.Connection, schema: str) -> set[str]:
    """The tables kept for reuse: each exists, and is attached nowhere."""
    rows = db.execute(
        sql.SQL(
            "SELECT s.relname, to_regclass(format('%%I.%%I', %s::text, s.relname)) IS NOT NULL,"
            " EXISTS (SELECT 1 FROM pg_inherits AS i"
            "         WHERE i.inhrelid = to_regclass(format('%%I.%%I', %s::text, s.relname)))"
            " FROM {} AS s"
        ).format(sql.Identifier(schema, "spare")),
        (schema, schema),
    ).fetchall()
    assert all(exists and not attached for _, exists, attached in rows), rows
    return {name for name, _, _ in rows}


def _tables(db: psycopg.Connection, schema: str) -> set[str]:
    rows = db.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
        (schema,),
    ).fetchall()
    return {name for (name,) in rows}


def _relnames(db: psycopg.Connection, schema: str) -> list[str]:
    """The tables the generations are in now."""
    query = sql.SQL("SELECT relname FROM {} ORDER BY gen").format(
        sql.Identifier(schema, "generation")
    )
    return [name for (name,) in db.execute(query).fetchall()]


def _bytes(db: psycopg.Connection, schema: str, gen: int) -> int:
    row = db.execute(
        "SELECT pg_total_relation_size(%s::regclass)", (f'"{schema}".message_store_{gen}',)
    ).fetchone()
    assert row is not None
    return int(row[0])


def _publish(conn: Connection, n: int, **kwargs: Any) -> None:
    producer = Producer(conn)
    for i in range(n):
        producer.publish({"i": i}, routing_key=QUEUE, **kwargs)


def _gen_of(db: psycopg.Connection, schema: str, where: str, *params: Any) -> list[int]:
    query = sql.SQL("SELECT gen FROM {} WHERE " + where + " ORDER BY id").format(  # noqa: S608
        sql.Identifier(schema, "message_store")
    )
    return [gen for (gen,) in db.execute(query, params).fetchall()]


def test_a_drained_generation_waits_for_a_snapshot_that_may_see_its_rows(
    rotating: Connection, holder: psycopg.Connection, db: psycopg.Connection, schema: str
) -> None:
    """TRUNCATE is not MVCC-safe: a generation emptied under a snapshot older than the
    acks that drained it would look empty to that snapshot, so a dump that had not locked
    it yet would miss messages that were waiting when it began. It waits for that
    snapshot to end; claims skip it meanwhile; then it is emptied, and its table is kept
    for the next generation, never dropped."""
    _publish(rotating, 300)
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM pg_class").fetchone()  # the snapshot is taken
    rotate(_store(rotating))  # generation 2 is current; the 300 are in 1
    assert len(drain(rotating, QUEUE)) == 300
    for _ in range(3):
        rotate(_store(rotating))  # 1 is drained, and would be emptied but for the snapshot

    assert _generations(db, schema)[1] == "drained"
    # the snapshot, as a dump's COPY reads each table, still sees every message it saw
    seen = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message_store"))
    assert holder.execute(seen).fetchone() == (300,)
    _publish(rotating, 1)
    assert drain(rotating, QUEUE) == [{"i": 0}]  # claims skip it meanwhile

    holder.rollback()  # the snapshot ends
    rotate(_store(rotating))
    assert 1 not in _generations(db, schema)
    assert _partition_exists(db, schema, 1)
    spares = _spares(db, schema)
    assert "message_store_1" in spares
    tables = _tables(db, schema)
    for _ in range(3):
        rotate(_store(rotating))
    # the next generations took spares: a table is created only when none is left
    assert _tables(db, schema) == tables
    taken = spares - _spares(db, schema)
    assert taken and taken <= set(_relnames(db, schema))
    _publish(rotating, 2)
    assert len(drain(rotating, QUEUE)) == 2


def test_tables_listed_by_a_session_all_exist_after_generations_turn(
    rotating: Connection, holder: psycopg.Connection, schema: str
) -> None:
    """What pg_dump, vacuumdb or a schema inspector does: list the tables, then lock each.
    Generations turn through several between the two, and every listed table is there."""
    store = _store(rotating)
    for _ in range(4):  # a few generations, some emptied
        _publish(rotating, 20)
        rotate(store)
        assert len(drain(rotating, QUEUE)) == 20
    listed = [
        name
        for (name,) in holder.execute(
            "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n"
            " ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            (schema,),
        ).fetchall()
    ]
    holder.commit()
    assert sum(name.startswith("message_store_") for name in listed) >= 3
    for _ in range(12):  # generations drain, are emptied and recycled
        _publish(rotating, 20)
        rotate(store)
        assert len(drain(rotating, QUEUE)) == 20
    with holder.transaction():
        for name in listed:
            holder.execute(
                sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(sql.Identifier(schema, name))
            )


def test_a_generation_a_reader_holds_a_lock_on_waits_for_it_and_claims_do_not(
    rotating: Connection, holder: psycopg.Connection, db: psycopg.Connection, schema: str
) -> None:
    _publish(rotating, 50)
    with holder.transaction():
        # what pg_dump does for its whole run: ACCESS SHARE on every table, partitions
        # included, and a snapshot
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                sql.Identifier(schema, "message_store")
            )
        )
        holder_pid = holder.info.backend_pid
        rotate(_store(rotating))
        assert len(drain(rotating, QUEUE)) == 50
        for _ in range(3):
            rotate(_store(rotating))
            # the queue keeps flowing: no statement waits behind the rotation
            _publish(rotating, 1)
            assert drain(rotating, QUEUE) == [{"i": 0}]
        # acks go in batches from a thread: one in flight while a step looked for
        # readers is a reader too, and the step may name it; none is left for the last
        rotating.transport.flush_acks()
        rotate(_store(rotating))

        generations = _generations(db, schema)
        assert generations[1] == "drained"  # claims skip it, its space waits
        blocked = db.execute(
            sql.SQL("SELECT blocked_by FROM {} WHERE gen = 1").format(
                sql.Identifier(schema, "generation")
            )
        ).fetchone()
        assert blocked == (holder_pid,)
        # generations attached after the reader started are emptied as usual
        assert max(generations) >= 5
        oldest = db.execute(
            sql.SQL("SELECT oldest FROM {}").format(sql.Identifier(schema, "rotation"))
        ).fetchone()
        assert oldest is not None and oldest[0] > 1
        # and an operator sees what waits for whom, in `celery pgqueue queues` and metrics
        monitor = Monitor(_store(rotating))
        line = storage_waits(monitor.generations())
        assert line is not None and f"pid {holder_pid}" in line, line
        assert _metric(monitor, "pgqueue_storage_waiting_bytes") > 0
        assert _metric(monitor, "pgqueue_storage_waiting_seconds") >= 0

    rotate(_store(rotating))  # the reader ended
    assert 1 not in _generations(db, schema)
    assert "message_store_1" in _spares(db, schema)  # kept for the next generation
    assert storage_waits(monitor.generations()) is None
    assert _metric(monitor, "pgqueue_storage_waiting_bytes") == 0


#: what the statements that run for every message are given, beside the Store's own
#: parameters (the queue of these tests, a lease, a message)
_PER_MESSAGE = {
    "claim": {"queue": QUEUE, "limit": 10, "max_attempts": 5, "lease_seconds": 60.0},
    "ack_many": {"ids": [1, 2], "leases": [7, 7]},
    "renew": {"ids": [1, 2], "leases": [7, 7], "lease_seconds": 60.0},
    "poll": {"queues": [QUEUE], "check": [QUEUE]},
    "publish": {"queue": QUEUE, "priority": 0, "body": b"x", "headers": "{}", "properties": "{}"},
}
_PER_MESSAGE["publish_replacing"] = _PER_MESSAGE["publish"] | {"dedup_key": "k"}


@pytest.mark.parametrize("name", sorted(_PER_MESSAGE))
def test_statements_leave_the_generations_a_dump_keeps_unopened(
    rotating: Connection, holder: psycopg.Connection, db: psycopg.Connection, schema: str, name: str
) -> None:
    """A pg_dump keeps the drained generations from being dropped until it ends. The
    statements that run for every message skip them before they start, in the generic
    plan a prepared statement settles on: their cost does not grow with the dump."""
    store = _store(rotating)
    for _ in range(3):  # the current generation is in an era (migration 0014)
        rotate(store)
    with holder.transaction():
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                sql.Identifier(schema, "message_store")
            )
        )
        for _ in range(8):
            _publish(rotating, 1)
            rotate(store)
            assert drain(rotating, QUEUE) == [{"i": 0}]
        generations = _generations(db, schema)
        live = {g for g, state in generations.items() if state in ("live", "current", "next")}
        assert len(generations) - len(live) >= 3  # drained or emptied, not dropped

        _, keys = store.positional(name)
        params = {k: None for k in keys} | {"channel": "c", "floor": store.generations.floor}
        params |= {"synchronous_commit": None, "lease": 7} | _PER_MESSAGE[name]
        row = plans.generic_plan(db, schema, name, params)
    read = {
        int(node["Relation Name"].rsplit("_", 1)[1])
        for node in plans.nodes(row[0][0]["Plan"])
        if node.get("Relation Name", "").startswith("message_store_")
    }
    if name == "publish":
        # an INSERT, routed to the current generation as it runs: its plan names none
        # (publish_replacing's UPDATE does)
        assert read == set()
    else:
        assert read and read <= live, f"{name} opens generations {sorted(read - live)}"


def _rotation_due(db: psycopg.Connection, schema: str) -> None:
    """Until 0.1 s (rotate_interval) have passed since the last rotation."""
    age = sql.SQL("SELECT now() - rotated_at >= interval '0.1 s' FROM {}").format(
        sql.Identifier(schema, "rotation")
    )
    wait_for(lambda: db.execute(age).fetchone()[0], 5, "a rotation to be due")  # type: ignore[index]


def _current(db: psycopg.Connection, schema: str) -> int:
    return next(g for g, state in _generations(db, schema).items() if state == "current")


def test_the_steps_wait_for_locks_and_readers_as_the_policy_says(
    rotating: Connection, db: psycopg.Connection, schema: str
) -> None:
    """_rotation names the two waits that function rotate and rotate_recycle write as
    literals (a change takes a migration): the live functions say the same."""

    def definition(function: str) -> str:
        row = db.execute(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc AS p"
            " JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s AND p.proname = %s",
            (schema, function),
        ).fetchone()
        assert row is not None
        return str(row[0])

    lock_timeout = f"'{STEP_LOCK_TIMEOUT * 1000:g}ms'"
    assert f"set_config('lock_timeout', {lock_timeout}, true)" in definition("rotate")
    held = f"interval '{READER_HOLD_SECONDS:g} seconds'"
    assert f"x.blocked_since <= now() - {held}" in definition("rotate_recycle")


def test_an_oversized_generation_starts_the_next(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    """A generation that grew while a snapshot was held keeps its size after VACUUM (its
    dead rows become free space, no longer counted as dead): past generation_max_bytes
    the next one starts at once, and this one is emptied when it drains."""
    rotating = make_connection(generation_max_age=0)
    Queue(QUEUE, channel=rotating.default_channel).declare()
    _publish(rotating, 400)
    grown = _bytes(db, schema, 1)
    assert len(drain(rotating, QUEUE)) == 400
    # a rotation every 0.1 s at most, and every hour by age
    sized = make_connection(
        generation_max_bytes=int(grown * 0.7), generation_max_age=3600, rotate_interval=0.1
    )
    store = _store(sized)
    rotate(store)  # reads the current generation's bytes
    _rotation_due(db, schema)
    rotate(store)
    assert _current(db, schema) == 2  # started for its size, not its age


def test_a_generation_a_snapshot_kept_from_vacuum_starts_the_next_once_the_snapshot_ends(
    make_connection: Callable[..., Connection],
    holder: psycopg.Connection,
    db: psycopg.Connection,
    schema: str,
) -> None:
    """While a snapshot is held, the rows acked since stay, and the current generation
    grows with them; when it ends, VACUUM makes them free space, and the generation
    would keep its size until its age. A VACUUM that left many dead rows, then one that
    left few: the next generation starts at the next rotation, and this one is emptied
    when it drains (a 30-second dump left 45 MB behind for 10 minutes without this)."""
    # a rotation every 0.1 s at most, every hour by age, and at 3,000 dead rows (never
    # here); "many" dead rows after a VACUUM is 300, "few" under a quarter of the most
    conn = make_connection(generation_max_age=3600, rotate_interval=0.1, generation_dead_rows=3000)
    Queue(QUEUE, channel=conn.default_channel).declare()
    store = _store(conn)
    rotate(store)
    held = _current(db, schema)
    vacuum = sql.SQL("VACUUM {}").format(sql.Identifier(schema, f"message_store_{held}"))

    def vacuumed() -> Any:
        """The current generation as read after a VACUUM (statistics of the acks may
        reach the server after one: the callers wait for what they expect)."""
        db.execute(vacuum)
        store.read_floor(now=True)
        return store.generations.current

    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")  # the snapshot, older than the acks to come
    _publish(conn, 400)
    assert len(drain(conn, QUEUE)) == 400
    wait_for(lambda: vacuumed().held, 30, "a VACUUM that leaves the acked rows dead")
    _rotation_due(db, schema)
    rotate(store)
    assert _current(db, schema) == held  # still held: its space cannot come back yet

    holder.rollback()  # the snapshot ends
    wait_for(lambda: vacuumed().rotations_due, 30, "a VACUUM that removes the acked rows")
    _rotation_due(db, schema)
    rotate(store)
    assert _current(db, schema) > held  # started because the snapshot ended, not for age
    _rotation_due(db, schema)
    rotate(store)  # and again: the held one is older than the previous one now
    assert held not in _generations(db, schema)  # it held nothing: emptied, kept for reuse
    assert f"message_store_{held}" in _spares(db, schema)
    _rotation_due(db, schema)
    rotate(store)
    assert store.generations.current.rotations_due == 0  # from now on, by age (or size, dead rows)


def _eras(db: psycopg.Connection, schema: str) -> dict[int, bool]:
    rows = db.execute(
        sql.SQL("SELECT base, closed FROM {} ORDER BY base").format(sql.Identifier(schema, "era"))
    ).fetchall()
    return dict(rows)


def _partitions(db: psycopg.Connection, schema: str) -> int:
    row = db.execute(
        "SELECT count(*) FROM pg_partition_tree(%s::regclass) WHERE isleaf",
        (f'"{schema}".message_store',),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_reader_that_holds_the_current_era_closes_it_and_generations_go_on(
    rotating: Connection, holder: psycopg.Connection, db: psycopg.Connection, schema: str
) -> None:
    """pg_dump locks every table there is when it starts, the current generation's era
    included, so none of that era's generations can be dropped until it ends. The era is
    closed and the next generation starts a new one: however long the dump, the
    generations it did not lock are dropped as they empty (migration 0014)."""
    store = _store(rotating)
    for _ in range(3):
        rotate(store)
    assert len(_eras(db, schema)) == 1  # the current generation's
    with holder.transaction():
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                sql.Identifier(schema, "message_store")
            )
        )
        for _ in range(30):  # 30 generations started while the dump runs
            _publish(rotating, 2)
            rotate(store)
            assert len(drain(rotating, QUEUE)) == 2  # the queue keeps flowing
        generations = _generations(db, schema)
        # the dump's own (the era's and the two from before eras) and a few live ones;
        # without eras, every one of the 30 stays until the dump ends
        assert len(generations) <= 12, generations
        assert _partitions(db, schema) == len(generations)
        eras = _eras(db, schema)
        assert list(eras.values())[0] is True and list(eras.values())[-1] is False, eras

    for _ in range(6):  # the dump ended
        rotate(store)
    assert len(_generations(db, schema)) <= 4
    assert list(_eras(db, schema).values()) == [False]  # the closed one is gone
    _publish(rotating, 1)
    assert drain(rotating, QUEUE) == [{"i": 0}]


def _metric(monitor: Monitor, name: str) -> float:
    collector = PgQueueCollector(monitor, counters=False, min_interval=0)
    found = [s.value for m in collector.collect() for s in m.samples if s.name == name]
    assert len(found) == 1, (name, found)
    return float(found[0])


def test_messages_that_would_pin_an_old_generation_move_forward(
    rotating: Connection, db: psycopg.Connection, schema: str, later: Callable[[float], Any]
) -> None:
    # an ETA a week away, and a message whose consumer died holding it
    Producer(rotating).publish({"eta": 1}, routing_key=QUEUE)
    table = sql.Identifier(schema, "message_store")
    db.execute(
        sql.SQL("UPDATE {} SET delayed = true, next_iteration = now() + interval '7 days'").format(
            table
        )
    )
    Producer(rotating).publish({"dead": 1}, routing_key=QUEUE)
    store = _store(rotating)
    assert len(store.claim(QUEUE, 1, 777)) == 1
    # its lease ran out long ago (the clock moved, not slept)
    db.execute(
        sql.SQL(
            "UPDATE {} SET next_iteration = now() - interval '1 hour' WHERE lease = 777"
        ).format(table)
    )
    assert _gen_of(db, schema, "true") == [1, 1]

    for _ in range(3):
        rotate(store)

    assert _gen_of(db, schema, "true") == [3, 3]  # taken along when 1 was two behind
    assert 1 not in _generations(db, schema)
    assert drain(rotating, QUEUE) == [{"dead": 1}]  # the lapsed lease is delivered again


def test_a_dedup_key_holds_across_generations(
    rotating: Connection, db: psycopg.Connection, schema: str
) -> None:
    keyed = {"headers": {"dedup_key": "once"}}
    _publish(rotating, 1, **keyed)
    for _ in range(3):
        rotate(_store(rotating))
    assert _gen_of(db, schema, "dedup_key = 'once'") == [3]  # moved, still waiting
    assert 1 not in _generations(db, schema)

    _publish(rotating, 1, **keyed)
    assert _store(rotating).size(QUEUE) == 1
    assert drain(rotating, QUEUE) == [{"i": 0}]
    _publish(rotating, 1, **keyed)  # the key is free once its message is gone
    assert _store(rotating).size(QUEUE) == 1


def test_the_storage_rotates_while_the_consuming_thread_runs_a_long_task(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    """Celery's solo pool runs a task in the consuming thread, for as long as it takes:
    the rotation goes on meanwhile (on a thread of its own, like the lease renewals),
    so that an hour's task does not leave an hour of acks in one generation."""
    conn = make_connection(rotate_interval=0.1, generation_max_age=0, polling_interval=0.2)
    Queue(QUEUE, channel=conn.default_channel).declare()
    _publish(conn, 1)
    seen: list[int] = []

    def long_task(body: Any, message: Any) -> None:
        first = _current(db, schema)
        # the consuming thread is here until the storage has moved on twice
        seen.append(
            wait_for(
                lambda: (g := _current(db, schema)) >= first + 2 and g,
                30,
                "two rotations while the task runs",
                details=lambda: _generations(db, schema),
            )
        )
        message.ack()

    with Consumer(conn, [Queue(QUEUE)], callbacks=[long_task]):
        conn.drain_events(timeout=30)

    assert len(seen) == 1


def _previous_publish(db: psycopg.Connection, schema: str, i: int, key: str | None = None) -> None:
    """A publish as the previous version sends it: into table message, its dedup keys
    kept by the table's unique index."""
    db.execute(
        sql.SQL(
            "INSERT INTO {} (queue, dedup_key, body, content_type, content_encoding,"
            " headers, properties) VALUES (%s, %s, %s, 'application/json', 'utf-8', '{{}}', '{{}}')"
            " ON CONFLICT (queue, dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING"
        ).format(sql.Identifier(schema, "message")),
        (QUEUE, key, f'{{"i": {i}}}'.encode()),
    )


def test_an_upgrade_in_place_with_a_consumer_running_loses_nothing(
    dsn: str, schema: str, db: psycopg.Connection, make_connection: Callable[..., Connection]
) -> None:
    migrate(dsn, schema, to=11)  # the previous version's schema, with a backlog
    for i in range(100):
        _previous_publish(db, schema, i, key=f"k{i}" if i % 10 == 0 else None)
    migrate(dsn, schema)
    _previous_publish(db, schema, 999, key="k0")  # its key is held: skipped

    conn = make_connection(rotate_interval=0.1, polling_interval=0.2)
    got: list[int] = []

    def on_message(body: dict[str, int], message: Any) -> None:
        got.append(body["i"])
        message.ack()

    with Consumer(conn, [Queue(QUEUE)], callbacks=[on_message]):
        # a rolling deploy: the previous version's publishers go on, and this one's begin
        for i in range(100, 150):
            _previous_publish(db, schema, i)
        producer = Producer(conn)
        for i in range(150, 200):
            producer.publish({"i": i}, routing_key=QUEUE)

        def all_in() -> bool:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
            return len(got) >= 200

        wait_for(all_in, 30, "every message, the previous version's too", details=lambda: len(got))

    assert sorted(got) == list(range(200))
    left = db.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message"))
    ).fetchone()
    assert left == (0,)


def _as_version_13(db: psycopg.Connection, schema: str, first: int) -> None:
    """Fifteen publishes and a rotation as a process of the previous version makes them:
    rows into message_store, then each step once, by the function the schema has."""
    for i in range(first, first + 15):
        db.execute(
            sql.SQL(
                "INSERT INTO {} (queue, body, content_type, content_encoding, headers,"
                " properties) VALUES (%s, %s, 'application/json', 'utf-8', '{{}}', '{{}}')"
            ).format(sql.Identifier(schema, "message_store")),
            (QUEUE, f'{{"i": {i}}}'.encode()),
        )
    for step in ("move", "drain", "empty", "drop"):
        db.execute(
            sql.SQL("SELECT * FROM {}.rotate(%s, 'pgqueue', 0, 0, 1, 10000, 64)").format(
                sql.Identifier(schema)
            ),
            (step,),
        )


def _outside_eras(db: psycopg.Connection, schema: str) -> int:
    """Generations attached to message_store itself, as before migration 0014."""
    row = db.execute(
        "SELECT count(*) FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %s::regclass AND c.relkind = 'r'",
        (f'"{schema}".message_store',),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_an_upgrade_to_eras_delivers_what_the_generations_before_it_hold(
    dsn: str, schema: str, db: psycopg.Connection, make_connection: Callable[..., Connection]
) -> None:
    """Migration 0014 with generations of migration 0012's kind holding messages: what
    they hold is delivered, they are dropped as they drain, and the new ones are in eras."""
    migrate(dsn, schema, to=13)
    for first in range(0, 60, 15):
        _as_version_13(db, schema, first)
    assert _outside_eras(db, schema) >= 3
    migrate(dsn, schema)  # what the first worker of the new version does as it starts

    conn = make_connection(rotate_interval=0.1, generation_max_age=0, polling_interval=0.2)
    got: list[int] = []

    def on_message(body: dict[str, int], message: Any) -> None:
        got.append(body["i"])
        message.ack()

    with Consumer(conn, [Queue(QUEUE)], callbacks=[on_message]):
        producer = Producer(conn)
        for i in range(60, 100):
            producer.publish({"i": i}, routing_key=QUEUE)

        def settled() -> bool:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
            return len(got) >= 100 and _outside_eras(db, schema) == 0

        wait_for(
            settled,
            30,
            "every message, and the generations from before eras dropped",
            details=lambda: (len(got), _generations(db, schema)),
        )

    assert sorted(got) == list(range(100))
    assert _eras(db, schema)


def test_a_long_task_moves_forward_as_its_lease_is_renewed(
    rotating: Connection, db: psycopg.Connection, schema: str
) -> None:
    """Its consumer lives and renews; its message keeps no old generation alive, and
    the generations after it go while it runs."""
    Producer(rotating).publish({"long": 1}, routing_key=QUEUE)
    store = _store(rotating)
    (held,) = store.claim(QUEUE, 1, 4242)
    for _ in range(3):
        rotate(store)
    assert _gen_of(db, schema, "true") == [1]  # held: the rotation leaves it alone
    _publish(rotating, 5)
    rotate(store)
    assert len(drain(rotating, QUEUE)) == 5
    rotate(store)  # 3 emptied, although 1 is older and live
    assert 3 not in _generations(db, schema)

    assert store.renew([held.id], [4242]) == {held.id}  # what its lease keeper sends

    assert _gen_of(db, schema, "true") == [6]
    rotate(store)
    assert 1 not in _generations(db, schema)
    assert store.ack(held.id, 4242)
