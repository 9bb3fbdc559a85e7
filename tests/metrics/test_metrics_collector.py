"""PgQueueCollector: gauges from the monitor, cached between scrapes; counters that move
when a Kombu consumer claims, acks, rejects and renews."""

from __future__ import annotations

import os
from typing import Any

from kombu import Connection, Consumer, Producer, Queue
from metrics_app import Samples, parse, scrape, value
from prometheus_client import CollectorRegistry, generate_latest
from waiting import wait_for

from celery_pgqueue.metrics import PgQueueCollector, serve
from kombu_pgqueue._monitor import Monitor
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Store


def collected(collector: PgQueueCollector) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def get(conn: Connection, queue: str) -> Any:
    """Claim exactly one message (basic_get), held until acked."""
    found = wait_for(lambda: conn.default_channel.basic_get(queue), 5, f"a message in {queue}")
    return found


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return (value(after, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)


def test_gauges_by_queue_and_state(connection: Connection, monitor: Monitor, schema: str):
    with connection.SimpleQueue("jobs") as jobs:
        for i in range(3):
            jobs.put({"n": i})
        get(connection, "jobs")  # held, not acked: leased

    samples = collected(PgQueueCollector(monitor, counters=False))

    assert value(samples, "pgqueue_up", schema=schema) == 1.0
    states = {
        state: value(samples, "pgqueue_queue_messages", queue="jobs", state=state)
        for state in ("ready", "leased", "delayed", "dead")
    }
    assert states == {"ready": 2.0, "leased": 1.0, "delayed": 0.0, "dead": 0.0}
    assert value(samples, "pgqueue_queue_messages_exact", queue="jobs", state="ready") == 1.0
    assert value(samples, "pgqueue_queue_oldest_ready_age_seconds", queue="jobs") >= 0.0
    assert value(samples, "pgqueue_table_live_rows", table="message") is not None
    assert value(samples, "pgqueue_monitor_query_seconds") > 0.0
    assert not [name for name, _ in samples if name.endswith("_total")]


def test_scrapes_within_the_interval_share_one_query_set(connection, monitor):
    clock = [100.0]
    collector = PgQueueCollector(monitor, counters=False, min_interval=10, clock=lambda: clock[0])
    with connection.SimpleQueue("cached") as cached:
        cached.put({"n": 1})
        first = collector.snapshot()
        cached.put({"n": 2})
        clock[0] += 9.9
        assert collector.snapshot() is first
        clock[0] += 0.2
        second = collector.snapshot()

    assert second is not first
    assert [d.ready for d in first.depths] == [1]
    assert [d.ready for d in second.depths] == [2]


def test_a_database_that_cannot_be_reached_reports_up_zero(dsn):
    store = Store(
        "host=127.0.0.1 port=1 dbname=nothing connect_timeout=2",
        parse_options({"schema": "absent", "auto_migrate": False}),
    )

    samples = collected(PgQueueCollector(Monitor(store)))

    assert value(samples, "pgqueue_up", schema="absent") == 0.0
    assert not [name for name, _ in samples if name == "pgqueue_queue_messages"]
    assert value(samples, "pgqueue_acked_total") is not None  # counters are still served


def test_counters_move_when_a_consumer_claims_acks_rejects_and_renews(make_connection):
    collector = PgQueueCollector(counters=True)
    before = collected(collector)
    conn = make_connection(visibility_timeout=2, lease_renewal_interval=0.1)
    with conn.SimpleQueue("counted") as queue:
        for i in range(4):
            queue.put({"n": i})
        first, second, third = (get(conn, "counted") for _ in range(3))
        wait_for(
            lambda: delta(before, collected(collector), "pgqueue_lease_renewals_total") >= 3,
            10,
            "the lease keeper to renew the three held leases",
        )
        first.ack()
        second.reject()  # to the dead letters
        third.requeue()
        get(conn, "counted").ack()  # the requeued one
        after = collected(collector)

    assert delta(before, after, "pgqueue_claimed_total", queue="counted") == 4
    assert delta(before, after, "pgqueue_redelivered_total", queue="counted") == 1
    assert delta(before, after, "pgqueue_acked_total") == 2
    assert delta(before, after, "pgqueue_rejected_total") == 1
    assert delta(before, after, "pgqueue_requeued_total") == 1
    assert delta(before, after, "pgqueue_lease_renewals_total") >= 3
    assert not [name for name, _ in after if name == "pgqueue_up"]  # no monitor, no gauges


def test_a_redelivery_is_counted(make_connection):
    collector = PgQueueCollector()
    before = collected(collector)
    conn = make_connection()
    with conn.SimpleQueue("again") as queue:
        queue.put({"n": 1})
        get(conn, "again").requeue()
        get(conn, "again").ack()
    after = collected(collector)

    assert delta(before, after, "pgqueue_claimed_total", queue="again") == 2
    assert delta(before, after, "pgqueue_redelivered_total", queue="again") == 1


def test_a_queue_served_only_by_handoff_exports_its_counters(connection, make_connection):
    """At low load every message is handed off: no claim hands any out. The queue's
    counters were exported only after a claim or a redelivery, so its handoffs were
    never seen."""
    collector = PgQueueCollector()
    worker = make_connection(polling_interval=3600)
    got: list[Any] = []
    with Consumer(worker, [Queue("handed")], callbacks=[lambda body, message: got.append(message)]):
        worker.transport.consumer.deliver_pending(inline=True)  # its first claim: empty
        Producer(connection).publish({"n": 1}, routing_key="handed")
        worker.drain_events(timeout=10)
        got[0].ack()
        after = collected(collector)

    assert value(after, "pgqueue_handoffs_total", queue="handed") == 1
    assert value(after, "pgqueue_claimed_total", queue="handed") == 0
    assert value(after, "pgqueue_empty_claims_total", queue="handed") == 1
    assert value(after, "pgqueue_handbacks_total", queue="handed") == 0


def test_a_forked_process_does_not_hold_the_metrics_socket():
    # Celery's prefork pool forks after the worker's step started serving; a child that
    # kept the listening socket would keep the port taken after the worker stopped
    server = serve(PgQueueCollector(), 0, "127.0.0.1")
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if server.socket.fileno() == -1 else 1)
        _, status = os.waitpid(pid, 0)

        assert os.waitstatus_to_exitcode(status) == 0
        samples = scrape(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        assert value(samples, "pgqueue_acked_total") is not None
    finally:
        server.shutdown()
        server.server_close()
