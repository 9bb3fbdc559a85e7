"""Leases through Kombu: expiry and redelivery, renewal while held, release on close."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

import pytest
from helpers import fill
from kombu import Connection, Consumer, Producer, Queue
from waiting import wait_for

from kombu_pgqueue._store import new_lease
from kombu_pgqueue.admin import Broker
from kombu_pgqueue.records import Outgoing

Later = Callable[[float], datetime]


def test_claim_after_the_lease_ends_redelivers_and_fences_the_old_ack(
    connection: Connection,
    make_connection: Callable[..., Connection],
    later: Later,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fill(connection, "leased", range(1))
    held = connection.default_channel.basic_get("leased")
    other = make_connection().default_channel

    assert other.basic_get("leased") is None  # leased for visibility_timeout (60 s)
    assert other.store.claim("leased", 10, new_lease(), now=later(59)) == []
    lease = new_lease()
    [again] = other.store.claim("leased", 10, lease, now=later(61))

    assert again.id == held.delivery_info["pgqueue_id"]
    assert again.attempts == 2
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        held.ack()  # too late: the message now belongs to the new lease
    assert "after its lease ended" in caplog.text
    assert other.store.size("leased", now=later(62)) == 0
    assert other.store.ack(again.id, lease) is True


def test_renew_keeps_a_held_message_for_several_lease_periods(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    holder = make_connection(visibility_timeout=1, lease_renewal_interval=0.2)
    thief = make_connection(visibility_timeout=1, lease_renewal_interval=0.2)
    fill(holder, "renewed", range(1))
    message = holder.default_channel.basic_get("renewed")
    assert message is not None

    # three and a half lease periods in which another consumer keeps trying
    wait_for(
        lambda: thief.default_channel.basic_get("renewed"),
        3.5,
        "another consumer taking the held message",
        never=True,
    )
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        message.ack()
    assert "after its lease ended" not in caplog.text
    assert holder.default_channel.store.size("renewed") == 0


def test_release_on_channel_close_hands_messages_back_at_once(
    connection: Connection, make_connection: Callable[..., Connection]
) -> None:
    fill(connection, "released", range(3))
    channel = connection.channel()
    held = [channel.basic_get("released") for _ in range(3)]
    assert all(m is not None for m in held)
    other = make_connection().default_channel
    assert other.basic_get("released") is None

    channel.close()

    taken = [other.basic_get("released") for _ in range(3)]
    assert [m.payload if m else None for m in taken] == [0, 1, 2]


def test_release_on_connection_close_hands_consumed_messages_back_at_once(
    make_connection: Callable[..., Connection],
) -> None:
    consumer_conn = make_connection()
    fill(consumer_conn, "released-conn", range(4))
    got: list[object] = []
    Consumer(
        consumer_conn, [Queue("released-conn")], callbacks=[lambda body, message: got.append(body)]
    ).consume()
    consumer_conn.drain_events(timeout=5)
    assert got == [0, 1, 2, 3]
    other = make_connection().default_channel
    assert other.basic_get("released-conn") is None

    consumer_conn.release()

    taken = [other.basic_get("released-conn") for _ in range(4)]
    assert [m.payload if m else None for m in taken] == [0, 1, 2, 3]
    # they reached the callback: that delivery counts, so a message that takes its
    # consumer down every time reaches max_attempts instead of coming back forever
    assert [m.delivery_info["pgqueue_attempts"] for m in taken if m] == [2, 2, 2, 2]


def _out_of_attempts(make_connection: Callable[..., Connection], queue: str) -> int:
    """A Celery-like message in ``queue`` that was delivered once and never acked, under
    max_attempts 1 (its consumer closed: that delivery counts); returns its id."""
    conn = make_connection(max_attempts=1)
    Producer(conn).publish(
        {"x": 1},
        routing_key=queue,
        declare=[Queue(queue)],
        headers={"task": "proj.tasks.export", "id": "6f1c-task-id"},
    )
    channel = conn.channel()
    held = channel.basic_get(queue)
    assert held is not None
    channel.close()
    return int(held.delivery_info["pgqueue_id"])


def test_a_claim_that_dead_letters_a_message_out_of_attempts_says_so_in_one_warning(
    make_connection: Callable[..., Connection], caplog: pytest.LogCaptureFixture
) -> None:
    message_id = _out_of_attempts(make_connection, "exhausted")
    other = make_connection(max_attempts=1)

    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        assert other.default_channel.basic_get("exhausted") is None

    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"message {message_id} of queue 'exhausted'" in line
    assert "task proj.tasks.export[6f1c-task-id]" in line
    assert "1 delivery" in line
    assert f"celery -A <your app> pgqueue dead show {message_id}" in line
    [dead] = Broker.from_connection(other).dead_letters("exhausted")
    assert (dead.id, dead.reason, dead.attempts) == (message_id, "max_attempts", 1)


def test_release_leaves_acked_and_rejected_messages_alone(
    connection: Connection, make_connection: Callable[..., Connection]
) -> None:
    fill(connection, "mixed", range(3))
    channel = connection.channel()
    acked, rejected, kept = (channel.basic_get("mixed") for _ in range(3))
    acked.ack()
    rejected.reject(requeue=False)

    channel.close()

    other = make_connection().default_channel
    back = other.basic_get("mixed")
    assert back is not None and back.payload == kept.payload
    assert other.basic_get("mixed") is None
    assert [d.reason for d in other.store.dead_letters("mixed")] == ["rejected"]


@pytest.mark.parametrize("batch_acks", [True, False])
@pytest.mark.parametrize("action", ["ack", "reject", "requeue"])
def test_a_late_ack_on_a_closed_channel_is_no_crash_and_loses_nothing(
    make_connection: Callable[..., Connection], action: str, batch_acks: bool
) -> None:
    """Celery reopens its channel after a database restart; a task that finishes
    afterwards acks on the old one. That must not raise (it killed workers), and the
    message, released when the channel closed, is delivered again."""
    conn = make_connection(batch_acks=batch_acks)
    fill(conn, "late", range(1))
    channel = conn.channel()
    message = channel.basic_get("late")
    assert message is not None
    channel.close()
    getattr(message, action)()
    again = conn.channel().basic_get("late")
    assert again is not None and again.payload == 0


def test_requeue_and_release_take_the_time_as_a_parameter(store, later) -> None:
    """Made visible "now" by the statement's clock: a later now, given, is honoured."""
    for body in (b"requeued", b"released"):
        store.publish(Outgoing(queue="tq", body=body, headers="{}", properties="{}"))
    lease = new_lease()
    requeued, released = store.claim("tq", 2, lease)
    assert store.requeue(requeued.id, lease, now=later(3600))
    store.release([released.id], [lease], now=later(3600))
    assert store.claim("tq", 2, new_lease()) == []  # visible an hour from now, not before
    back = store.claim("tq", 2, new_lease(), now=later(3601))
    assert sorted(bytes(d.body) for d in back) == [b"released", b"requeued"]
