"""Store: one test group per named query, against a real schema. Time moves with ``now=``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest
from kombu import Connection
from psycopg import sql

from kombu_pgqueue._listener import Listener, legacy_token
from kombu_pgqueue._store import Outgoing, Store, new_lease

Later = Callable[[float], datetime]


def outgoing(queue: str, body: bytes | str = b"", **fields: object) -> Outgoing:
    if isinstance(body, str):
        body = body.encode()
    return Outgoing(queue=queue, body=body, headers="{}", properties="{}", **fields)  # type: ignore[arg-type]


# -- publish ---------------------------------------------------------------------


def test_publish_returns_the_id_and_size_counts_it(store: Store) -> None:
    first = store.publish(outgoing("q", "a"))
    second = store.publish(outgoing("q", "b"))

    assert isinstance(first, int) and isinstance(second, int)
    assert second > first
    assert store.size("q") == 2
    assert store.size("other") == 0


def test_publish_dedup_key_stores_one_message(store: Store) -> None:
    assert store.publish(outgoing("q", "a", dedup_key="k")) is not None
    assert store.publish(outgoing("q", "b", dedup_key="k")) is None
    assert store.publish(outgoing("other", "c", dedup_key="k")) is not None  # per queue

    assert store.size("q") == 1


def test_publish_notifies_the_schema_channel_with_the_queues_token(store: Store, dsn: str) -> None:
    # as a consumer of both queues that takes no handoffs (see tests/transport/test_handoff.py)
    watching = Listener(dsn, dataclasses.replace(store.options, handoff=False))
    watching.open()
    for queue in ("wake me", "ünï ☃"):
        store.declare_queue(queue)
    watching.watch(["wake me", "ünï ☃"])
    tokens = [watching.watched["wake me"], watching.watched["ünï ☃"]]
    try:
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(store.options.channel)))
            store.publish(outgoing("wake me", "x"))
            store.publish(outgoing("ünï ☃", "x"))
            payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
    finally:
        watching.close()

    # the statement's token is the consumer's: random, not the name nor a hash of it
    assert payloads == ["r:" + token for token in tokens]
    assert len(set(tokens)) == 2 and all(len(token) == 16 for token in tokens)
    assert tokens != [legacy_token("wake me"), legacy_token("ünï ☃")]


def test_publish_many_inserts_every_message(store: Store) -> None:
    inserted = store.publish_many([outgoing(f"q{i % 3}", str(i)) for i in range(300)])

    assert inserted == 300
    assert [store.size(f"q{i}") for i in range(3)] == [100, 100, 100]


def test_publish_many_of_nothing_inserts_nothing(store: Store) -> None:
    assert store.publish_many([]) == 0


# -- claim -----------------------------------------------------------------------


def test_claim_orders_by_priority_then_fifo(store: Store) -> None:
    priorities = [0, 5, 9, 5, 0, 9, 1]
    ids = [store.publish(outgoing("q", str(i), priority=p)) for i, p in enumerate(priorities)]

    claimed = store.claim("q", 100, new_lease())

    expected = sorted(zip(priorities, ids), key=lambda pair: (-pair[0], pair[1]))
    assert [(d.priority, d.id) for d in claimed] == expected


def test_claim_respects_the_limit(store: Store) -> None:
    for i in range(5):
        store.publish(outgoing("q", str(i)))

    assert len(store.claim("q", 2, new_lease())) == 2
    assert len(store.claim("q", 2, new_lease())) == 2
    assert len(store.claim("q", 2, new_lease())) == 1
    assert store.claim("q", 2, new_lease()) == []


def test_claim_counts_the_attempt_and_returns_the_body(store: Store) -> None:
    store.publish(
        Outgoing(
            queue="q",
            body=b"\x00\xffbinary",
            headers='{"h": 1}',
            properties='{"p": "x"}',
            content_type="application/data",
            content_encoding="binary",
        )
    )

    [delivered] = store.claim("q", 1, new_lease())

    assert delivered.attempts == 1
    assert bytes(delivered.body) == b"\x00\xffbinary"
    assert delivered.headers == '{"h": 1}'
    assert delivered.properties == '{"p": "x"}'
    assert delivered.content_type == "application/data"
    assert delivered.content_encoding == "binary"


def test_claim_skips_locked_rows(store: Store, db: psycopg.Connection, schema: str) -> None:
    ids = [store.publish(outgoing("q", str(i))) for i in range(3)]

    with db.transaction():
        db.execute(
            sql.SQL("SELECT id FROM {}.message_store WHERE id = %s FOR UPDATE").format(
                sql.Identifier(schema)
            ),
            (ids[0],),
        )
        claimed = store.claim("q", 10, new_lease())

    assert [d.id for d in claimed] == ids[1:]
    # once the other transaction is gone the skipped row is there to take
    assert [d.id for d in store.claim("q", 10, new_lease())] == ids[:1]


def test_claim_hides_leased_messages_until_the_lease_ends(store: Store, later: Later) -> None:
    message_id = store.publish(outgoing("q", "x"))
    [first] = store.claim("q", 1, new_lease(), now=later(0))

    assert store.claim("q", 1, new_lease(), now=later(0)) == []
    assert store.claim("q", 1, new_lease(), now=later(59)) == []
    [again] = store.claim("q", 1, new_lease(), now=later(61))

    assert first.id == again.id == message_id
    assert (first.attempts, again.attempts) == (1, 2)


def test_ack_is_fenced_by_the_lease(store: Store, later: Later) -> None:
    store.publish(outgoing("q", "x"))
    old, new = new_lease(), new_lease()
    [first] = store.claim("q", 1, old, now=later(0))
    store.claim("q", 1, new, now=later(61))  # the first lease ran out; someone else has it

    assert store.ack(first.id, old) is False
    assert store.size("q", now=later(62)) == 0  # still held by the new lease
    assert store.ack(first.id, new) is True
    assert store.ack(first.id, new) is False
    assert store.size("q", now=later(3600)) == 0


def test_ack_many_deletes_only_matching_leases(store: Store) -> None:
    for i in range(3):
        store.publish(outgoing("q", str(i)))
    lease = new_lease()
    claimed = store.claim("q", 3, lease)
    ids = [d.id for d in claimed]

    acked = store.ack_many(ids, [lease, lease, lease + 1])

    assert acked == 2
    assert store.size("q", now=None) == 0  # the third is still leased
    assert store.ack(ids[2], lease) is True


def test_claim_moves_exhausted_messages_to_dead_letter(
    make_connection: Callable[..., Connection], later: Later
) -> None:
    store = make_connection(max_attempts=2).default_channel.store
    message_id = store.publish(outgoing("q", "poison"))
    store.publish(outgoing("q", "fine"))

    first = store.claim("q", 1, new_lease(), now=later(0))
    second = store.claim("q", 1, new_lease(), now=later(61))
    third = store.claim("q", 1, new_lease(), now=later(122))

    assert [d.id for d in first] == [d.id for d in second] == [message_id]
    assert second[0].attempts == 2
    assert third == []  # buried, and it took the slot of this claim
    [dead] = store.dead_letters("q")
    assert (dead.id, dead.reason, dead.attempts, bytes(dead.body)) == (
        message_id,
        "max_attempts",
        2,
        b"poison",
    )
    [fine] = store.claim("q", 1, new_lease(), now=later(122))
    assert bytes(fine.body) == b"fine"


def test_claim_with_max_attempts_zero_never_dead_letters(
    make_connection: Callable[..., Connection], later: Later
) -> None:
    store = make_connection(max_attempts=0).default_channel.store
    store.publish(outgoing("q", "x"))

    attempts = [store.claim("q", 1, new_lease(), now=later(61 * n))[0].attempts for n in range(8)]

    assert attempts == list(range(1, 9))
    assert store.dead_letters() == []


def test_claim_skips_expired_messages(store: Store, later: Later) -> None:
    store.publish(outgoing("q", "short", expires_at=later(10)))

    assert store.claim("q", 1, new_lease(), now=later(11)) == []
    assert len(store.claim("q", 1, new_lease(), now=later(9))) == 1


def test_claim_ignores_delayed_messages_until_poll_promotes_them(
    store: Store, later: Later
) -> None:
    eta = later(30)
    store.publish(outgoing("q", "later", eta=eta))

    assert store.claim("q", 1, new_lease(), now=later(31)) == []  # still flagged delayed
    ready, due = store.poll(["q"], now=later(10))
    assert ready == set()
    assert due == pytest.approx(eta.timestamp(), abs=0.01)

    ready, due = store.poll(["q"], now=later(31))
    assert ready == {"q"}
    assert due is None
    assert [bytes(d.body) for d in store.claim("q", 1, new_lease(), now=later(31))] == [b"later"]


# -- take (no-ack) --------------------------------------------------------------


def test_take_removes_the_messages_it_hands_out(store: Store) -> None:
    for i, priority in enumerate([0, 3, 1]):
        store.publish(outgoing("q", str(i), priority=priority))

    taken = store.take("q", 2)

    assert [bytes(d.body) for d in taken] == [b"1", b"2"]
    assert all(d.attempts == 1 for d in taken)
    assert store.size("q") == 1
    assert store.dead_letters() == []


# -- requeue, release, bury, renew ---------------------------------------------


def test_requeue_makes_the_message_visible_at_once(store: Store) -> None:
    store.publish(outgoing("q", "x"))
    lease = new_lease()
    [first] = store.claim("q", 1, lease)

    assert store.requeue(first.id, lease) is True
    [again] = store.claim("q", 1, new_lease())  # no time moved

    assert again.id == first.id
    assert again.attempts == 2
    assert store.requeue(first.id, lease) is False  # the old lease is void


def test_release_hands_back_without_counting_the_attempt(store: Store) -> None:
    for i in range(3):
        store.publish(outgoing("q", str(i)))
    lease = new_lease()
    claimed = store.claim("q", 3, lease)

    store.release([d.id for d in claimed], [lease] * 3)
    again = store.claim("q", 3, new_lease())

    assert [d.id for d in again] == [d.id for d in claimed]
    assert [d.attempts for d in again] == [1, 1, 1]


def test_release_ignores_leases_that_are_not_held(store: Store) -> None:
    store.publish(outgoing("q", "x"))
    lease = new_lease()
    [claimed] = store.claim("q", 1, lease)

    store.release([claimed.id], [lease + 1])

    assert store.claim("q", 1, new_lease()) == []


def test_bury_moves_the_message_to_dead_letter(store: Store) -> None:
    store.publish(outgoing("q", "bad", priority=4))
    lease = new_lease()
    [claimed] = store.claim("q", 1, lease)

    assert store.bury(claimed.id, lease + 1, "rejected") is False
    assert store.bury(claimed.id, lease, "rejected") is True

    [dead] = store.dead_letters()
    assert (dead.id, dead.queue, dead.priority, dead.reason, bytes(dead.body)) == (
        claimed.id,
        "q",
        4,
        "rejected",
        b"bad",
    )
    assert store.size("q", now=None) == 0
    assert store.ack(claimed.id, lease) is False


def test_requeue_dead_brings_dead_letters_back_as_new(store: Store) -> None:
    store.publish(outgoing("q", "again"))
    lease = new_lease()
    [claimed] = store.claim("q", 1, lease)
    store.bury(claimed.id, lease, "rejected")

    assert store.requeue_dead([claimed.id]) == ["q"]
    [revived] = store.claim("q", 1, new_lease())

    assert bytes(revived.body) == b"again"
    assert revived.attempts == 1
    assert store.dead_letters() == []


def test_purge_dead_counts_what_it_removes(store: Store) -> None:
    for queue in ("a", "a", "b"):
        store.publish(outgoing(queue, "x"))
        lease = new_lease()
        [claimed] = store.claim(queue, 1, lease)
        store.bury(claimed.id, lease, "rejected")

    assert store.purge_dead("a") == 2
    assert [d.queue for d in store.dead_letters()] == ["b"]
    assert store.purge_dead() == 1


def test_renew_keeps_the_lease_past_its_first_end(store: Store, later: Later) -> None:
    store.publish(outgoing("q", "x"))
    lease = new_lease()
    [claimed] = store.claim("q", 1, lease, now=later(0))

    assert store.renew([claimed.id], [lease], now=later(50)) == {claimed.id}

    assert store.claim("q", 1, new_lease(), now=later(100)) == []
    assert len(store.claim("q", 1, new_lease(), now=later(111))) == 1


def test_renew_ignores_a_lease_taken_over(store: Store, later: Later) -> None:
    store.publish(outgoing("q", "x"))
    old = new_lease()
    [claimed] = store.claim("q", 1, old, now=later(0))
    store.claim("q", 1, new_lease(), now=later(61))

    assert store.renew([claimed.id], [old], now=later(62)) == set()
    assert store.renew([], []) == set()


# -- size, purge ---------------------------------------------------------------


def test_size_counts_waiting_not_leased_messages(store: Store, later: Later) -> None:
    for i in range(3):
        store.publish(outgoing("q", str(i)))
    store.claim("q", 1, new_lease(), now=later(0))

    assert store.size("q", now=later(1)) == 2
    assert store.size("q", now=later(61)) == 3  # the lease ran out


def test_purge_leaves_leased_messages_with_their_consumer(store: Store) -> None:
    for i in range(4):
        store.publish(outgoing("q", str(i)))
    lease = new_lease()
    [held] = store.claim("q", 1, lease)

    assert store.purge("q") == 3
    assert store.size("q") == 0
    assert store.ack(held.id, lease) is True


# -- sweep ---------------------------------------------------------------------


def test_sweep_removes_expired_messages_not_under_a_live_lease(store: Store, later: Later) -> None:
    store.publish(outgoing("q", "expires", expires_at=later(10)))
    store.publish(outgoing("q", "leased", expires_at=later(10)))
    store.publish(outgoing("q", "stays"))
    [leased] = store.claim("q", 1, new_lease(), now=later(0))

    assert store.sweep(now=later(11))["expired_messages"] == 1
    assert store.sweep(now=later(61))["expired_messages"] == 1  # once its lease ran out
    assert store.size("q", now=later(61)) == 1
    assert bytes(leased.body) == b"expires"


def test_sweep_removes_unused_expiring_queues(
    store: Store, later: Later, db: psycopg.Connection, schema: str
) -> None:
    store.declare_queue("temp", expires=1.0)
    store.declare_queue("kept")
    store.declare_exchange("ex", "direct")
    store.bind("ex", "temp", "temp", None)
    store.publish(outgoing("temp", "x"))

    assert store.sweep(now=later(10))["expired_queues"] == 0  # at least min_expires
    swept = store.sweep(now=later(31))

    assert swept == {"expired_messages": 0, "expired_queues": 1, "bindings": 1, "queue_messages": 1}
    assert store.queue_exists("temp") is False
    assert store.queue_exists("kept") is True
    assert store.bindings("ex") == []


def test_sweep_min_expires_can_be_lowered(store: Store, later: Later) -> None:
    store.declare_queue("temp", expires=2.0)

    assert store.sweep(now=later(1), min_expires=0)["expired_queues"] == 0
    assert store.sweep(now=later(3), min_expires=0)["expired_queues"] == 1


def test_poll_keeps_a_consumed_expiring_queue_alive(store: Store, later: Later) -> None:
    store.declare_queue("temp", expires=1.0)

    store.poll(["temp"], now=later(25))

    assert store.sweep(now=later(40))["expired_queues"] == 0
    assert store.sweep(now=later(56))["expired_queues"] == 1


def test_poll_reports_queues_with_ready_messages(store: Store) -> None:
    store.publish(outgoing("a", "x"))
    store.publish(outgoing("c", "x"))

    ready, due = store.poll(["a", "b"])

    assert ready == {"a"}
    assert due is None


def test_declare_queue_applies_message_ttl_to_new_messages(store: Store, later: Later) -> None:
    store.declare_queue("ttl", message_ttl=30.0)
    store.publish(outgoing("ttl", "x"))

    assert len(store.claim("ttl", 1, new_lease(), now=later(29))) == 1
    store.publish(outgoing("ttl", "y"))
    assert store.claim("ttl", 1, new_lease(), now=later(31)) == []


def test_declare_queue_message_ttl_keeps_the_sooner_expiration(store: Store, later: Later) -> None:
    store.declare_queue("ttl", message_ttl=30.0)
    store.publish(outgoing("ttl", "x", expires_at=later(5)))

    assert store.claim("ttl", 1, new_lease(), now=later(6)) == []


# -- queues, exchanges, bindings ------------------------------------------------


def test_delete_queue_removes_messages_and_bindings(store: Store) -> None:
    store.declare_queue("q")
    store.declare_exchange("ex", "fanout")
    store.bind("ex", "", "q", None)
    for i in range(3):
        store.publish(outgoing("q", str(i)))

    assert store.delete_queue("q") == 3
    assert store.queue_exists("q") is False
    assert store.bindings("ex") == []


def test_queue_exists_for_undeclared_queue_with_messages(store: Store) -> None:
    assert store.queue_exists("q") is False
    store.publish(outgoing("q", "x"))

    assert store.queue_exists("q") is True


def test_publish_routed_follows_exchange_type(store: Store) -> None:
    store.declare_exchange("d", "direct")
    store.declare_exchange("f", "fanout")
    store.declare_exchange("t", "topic")
    store.bind("d", "red", "q1", None)
    store.bind("d", "blue", "q2", None)
    store.bind("f", "", "q1", None)
    store.bind("f", "", "q2", None)
    store.bind("t", "a.*", "q1", r"^a\.[^.]+$")

    assert store.publish_routed("d", "red", outgoing("", "x")) == ["q1"]
    assert sorted(store.publish_routed("f", "ignored", outgoing("", "x"))) == ["q1", "q2"]
    assert store.publish_routed("t", "a.b", outgoing("", "x")) == ["q1"]
    assert store.publish_routed("t", "a.b.c", outgoing("", "x")) is None  # unroutable
    assert store.publish_routed("nowhere", "red", outgoing("", "x")) is None
    assert (store.size("q1"), store.size("q2")) == (3, 1)


def test_delete_exchange_removes_its_bindings(store: Store) -> None:
    store.declare_exchange("ex", "direct")
    store.bind("ex", "k", "q", None)

    store.delete_exchange("ex")

    assert store.exchange_type("ex") is None
    assert store.bindings("ex") == []
    store.declare_exchange("ex", "direct")
    assert store.publish_routed("ex", "k", outgoing("", "x")) is None  # nothing bound


def test_unbind_removes_one_binding(store: Store) -> None:
    store.declare_exchange("ex", "direct")
    store.bind("ex", "k", "q1", None)
    store.bind("ex", "k", "q2", None)

    store.unbind("ex", "k", "q1")

    assert store.bindings("ex") == [("k", None, "q2")]


def test_poll_looks_for_ready_messages_only_in_the_queues_it_is_asked_to_check(
    store: Store, later: Later
) -> None:
    store.declare_queue("kept", expires=1.0)
    store.publish(outgoing("kept", "x"))
    store.publish(outgoing("other", "x"))

    ready, _ = store.poll(["kept", "other"], now=later(25), check=["other"])

    assert ready == {"other"}
    # an unchecked queue is still kept alive
    assert store.sweep(now=later(40))["expired_queues"] == 0
