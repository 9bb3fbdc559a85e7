"""kombu_pgqueue.admin against a real database: messages go in and out through Kombu,
the admin API reads, requeues and deletes them, and each answer is checked against what
Kombu sees next."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from kombu import Connection, Producer

import kombu_pgqueue
from kombu_pgqueue import ConfigurationError, SchemaError, admin, migrations
from kombu_pgqueue.admin import Broker, Outgoing


def publish(connection: Connection, queue: str, n: int = 1, **headers: Any) -> None:
    producer = Producer(connection.default_channel)
    for i in range(n):
        producer.publish({"n": i}, routing_key=queue, headers=dict(headers))


def bodies(connection: Connection, queue: str) -> list[Any]:
    """Take every ready message of ``queue`` through Kombu, ack it, return its body."""
    found = []
    while (message := connection.default_channel.basic_get(queue)) is not None:
        found.append(message.decode())
        message.ack()
    return found


def reject(connection: Connection, queue: str, n: int) -> None:
    for _ in range(n):
        message = connection.default_channel.basic_get(queue)
        assert message is not None
        message.reject()  # into the dead letters


def outgoing(queue: str, n: int, **fields: Any) -> Outgoing:
    return Outgoing(
        queue=queue,
        body=b'{"n": %d}' % n,
        headers="{}",
        properties="{}",
        content_type="application/json",
        content_encoding="utf-8",
        **fields,
    )


@pytest.fixture
def broker(connection: Connection) -> Broker:
    return Broker.from_connection(connection)


def test_migrate_installs_the_schema_once(dsn: str, schema: str) -> None:
    broker = Broker(dsn, schema=schema)
    assert broker.schema_version() == 0

    applied = broker.migrate()

    assert applied and applied == sorted(applied)
    assert broker.schema_version() == applied[-1] == migrations.latest_version()
    assert broker.migrate() == []


def test_ensure_schema_migrates_only_when_auto_migrate_allows(dsn: str, schema: str) -> None:
    with pytest.raises(SchemaError, match=schema):
        Broker(dsn, schema=schema, auto_migrate=False).ensure_schema()
    assert Broker(dsn, schema=schema).schema_version() == 0

    Broker(dsn, schema=schema).ensure_schema()

    assert Broker(dsn, schema=schema).schema_version() == migrations.latest_version()
    Broker(dsn, schema=schema, auto_migrate=False).ensure_schema()  # current: no error


def test_a_dsn_a_broker_url_and_a_connection_reach_the_same_queues(
    connection: Connection, dsn: str, broker_base_url: str, schema: str
) -> None:
    publish(connection, "shared", 2)
    url_broker = Broker(broker_base_url, schema=schema)

    for broker in (Broker(dsn, schema=schema), url_broker, Broker.from_connection(connection)):
        assert [(s.queue, s.ready) for s in broker.queue_stats()] == [("shared", 2)]
        assert broker.schema == schema
    # the same connection string as the transport's: the two share a connection pool
    assert Broker.from_connection(connection).conninfo == url_broker.conninfo


def test_from_connection_overrides_options(connection: Connection, schema: str) -> None:
    broker = Broker.from_connection(connection, schema="elsewhere", auto_migrate=False)
    assert (broker.schema, broker.options.auto_migrate) == ("elsewhere", False)
    assert Broker.from_connection(connection).schema == schema


def test_a_connection_to_another_broker_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="not a pgqueue broker") as raised:
        Broker.from_connection(Connection("memory://"))
    assert isinstance(raised.value, ValueError)


def test_bad_transport_options_are_refused(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        Broker(dsn, visibility_timeout="soon")
    assert admin.parse_options({"schema": "s", "max_attempts": "3"}).max_attempts == 3


def test_queue_stats_count_ready_delayed_leased_and_dead(
    connection: Connection, broker: Broker
) -> None:
    publish(connection, "jobs", 4)
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    publish(connection, "jobs", 1, eta=later)
    held = connection.default_channel.basic_get("jobs")
    assert held is not None
    reject(connection, "jobs", 1)
    publish(connection, "other", 1)

    stats = {s.queue: s for s in broker.queue_stats()}

    jobs = stats["jobs"]
    assert (jobs.ready, jobs.delayed, jobs.leased, jobs.dead) == (2, 1, 1, 1)
    assert jobs.oldest_ready_age is not None and jobs.oldest_ready_age >= 0
    assert (stats["other"].ready, stats["other"].dead) == (1, 0)
    held.ack()


def test_purge_deletes_waiting_messages_and_leaves_leased_ones(
    connection: Connection, broker: Broker
) -> None:
    publish(connection, "jobs", 3)
    held = connection.default_channel.basic_get("jobs")
    assert held is not None

    assert broker.purge("jobs") == 2

    assert bodies(connection, "jobs") == []
    assert [(s.ready, s.leased) for s in broker.queue_stats()] == [(0, 1)]
    held.ack()  # its lease was left alone: the ack still counts
    assert broker.queue_stats() == []


def test_dead_letters_list_show_and_filter(connection: Connection, broker: Broker) -> None:
    publish(connection, "doomed", 3)
    publish(connection, "other", 1)
    reject(connection, "doomed", 3)
    reject(connection, "other", 1)

    everything = broker.dead_letters()
    doomed = broker.dead_letters("doomed")

    assert len(everything) == 4
    assert [d.queue for d in doomed] == ["doomed"] * 3
    assert [d.id for d in doomed] == sorted(d.id for d in doomed)  # oldest first
    assert [d.id for d in broker.dead_letters("doomed", limit=2)] == [d.id for d in doomed[:2]]
    assert len(broker.dead_letters(limit=None)) == 4
    shown = broker.dead_letter(doomed[0].id)
    assert shown == doomed[0]
    assert (shown.reason, shown.attempts, bytes(shown.body)) == ("rejected", 1, b'{"n": 0}')
    assert broker.dead_letter(max(d.id for d in everything) + 1000) is None


def test_a_dead_letter_names_its_celery_task_id(connection: Connection, broker: Broker) -> None:
    """The CLI shows a letter's task id; the record had none (issue 32, item 8)."""
    publish(connection, "named", 1, id="task-1", task="proj.add")
    publish(connection, "named", 1)  # not a Celery task: no id
    reject(connection, "named", 2)

    listed = broker.dead_letters("named")
    assert [d.task_id for d in listed] == ["task-1", None]
    shown = broker.dead_letter(listed[0].id)
    assert shown is not None and shown.task_id == "task-1"


def test_requeue_dead_puts_letters_back_in_their_queue(
    connection: Connection, broker: Broker
) -> None:
    publish(connection, "doomed", 2)
    reject(connection, "doomed", 2)
    first, second = broker.dead_letters("doomed")

    assert broker.requeue_dead([first.id]) == ["doomed"]

    assert [d.id for d in broker.dead_letters()] == [second.id]
    assert bodies(connection, "doomed") == [{"n": 0}]
    assert broker.requeue_dead([]) == []


def test_requeue_dead_leaves_a_letter_whose_dedup_key_is_taken(
    connection: Connection, broker: Broker
) -> None:
    publish(connection, "keyed", 1, dedup_key="order-7")
    reject(connection, "keyed", 1)
    publish(connection, "keyed", 1, dedup_key="order-7")  # a live message holds the key
    [letter] = broker.dead_letters("keyed")

    assert broker.requeue_dead([letter.id]) == []

    assert [d.id for d in broker.dead_letters()] == [letter.id]
    assert bodies(connection, "keyed") == [{"n": 0}]


def test_purge_dead_deletes_one_queue_or_all(connection: Connection, broker: Broker) -> None:
    for queue, n in (("a", 2), ("b", 1)):
        publish(connection, queue, n)
        reject(connection, queue, n)

    assert broker.purge_dead("a") == 2
    assert [d.queue for d in broker.dead_letters()] == ["b"]
    assert broker.purge_dead() == 1
    assert broker.dead_letters() == []


def test_publish_rows_stores_rows_and_skips_taken_dedup_keys(
    connection: Connection, broker: Broker
) -> None:
    rows = [outgoing("bulk", n, dedup_key=f"k{n}").row() for n in range(3)]

    assert broker.publish_rows(rows) == 3
    assert broker.publish_rows(rows[1:] + [outgoing("bulk", 3).row()]) == 1

    assert bodies(connection, "bulk") == [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]


def test_publish_many_inside_an_application_transaction(
    connection: Connection, broker: Broker, dsn: str
) -> None:
    with psycopg.connect(dsn) as conn:
        with conn.transaction(force_rollback=True), kombu_pgqueue.transaction(conn):
            assert broker.publish_many([outgoing("tx", 1)]) == 1
        with conn.transaction(), kombu_pgqueue.transaction(conn):
            assert broker.publish_many([outgoing("tx", 2), outgoing("tx", 3)]) == 2

    assert bodies(connection, "tx") == [{"n": 2}, {"n": 3}]


@pytest.mark.parametrize("binary", [False, True])
def test_load_staged_on_a_connection_of_ones_own(
    connection: Connection, dsn: str, schema: str, binary: bool
) -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    rows = [
        outgoing("staged", 0, dedup_key="a").row(),
        outgoing("staged", 1, eta=later).row(),
        outgoing("staged", 2).row(),
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert admin.load_staged(conn, rows, schema=schema, ordered=False, binary=binary) == 3
        assert admin.load_staged(conn, rows[:1], schema=schema, binary=binary) == 0
        assert admin.load_staged(conn, [], schema=schema) == 0

    assert sorted(m["n"] for m in bodies(connection, "staged")) == [0, 2]
    stats = Broker.from_connection(connection).queue_stats()
    assert [(s.queue, s.ready, s.delayed) for s in stats] == [("staged", 0, 1)]


def test_monitor_counts_exactly_up_to_its_cap(connection: Connection, broker: Broker) -> None:
    publish(connection, "deep", 3)
    held = connection.default_channel.basic_get("deep")
    assert held is not None

    [exact] = broker.monitor().queue_depths()
    [capped] = broker.monitor(cap=1).queue_depths()

    assert exact.counts == {"ready": 2, "leased": 1, "delayed": 0, "dead": 0}
    assert all(exact.exact.values())
    assert (capped.queue, capped.ready_exact) == ("deep", False)
    tables = {t.table: t for t in broker.monitor().table_sizes()}
    assert {"message", "dead_letter"} <= set(tables)
    assert tables["message"].total_bytes > 0
    with pytest.raises(ValueError, match="cap"):
        broker.monitor(cap=-1)
    held.ack()


def test_counters_count_this_process_claims_and_acks(connection: Connection) -> None:
    before = admin.counters()
    publish(connection, "counted", 2)
    taken = bodies(connection, "counted")

    after = admin.counters()

    def grew(event: str, queue: str) -> int:
        return after.get((event, queue), 0) - before.get((event, queue), 0)

    assert len(taken) == 2
    assert grew("claimed", "counted") == 2
    assert grew("acked", "") == 2
    assert {event for event, _ in after} <= set(admin.COUNTER_EVENTS)
