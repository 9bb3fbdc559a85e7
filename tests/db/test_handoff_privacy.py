"""What a role with no grants on the broker's tables learns from its notifications.

PostgreSQL has no privilege on a LISTEN channel: any role that may connect may LISTEN
on the broker's channel and reads every payload. It must learn no body, no argument and
no queue name from them (docs/operations.md, "What a stranger can see"), while handoffs
stay on by default. The stranger here is a LOGIN role with PUBLIC's rights only.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from helpers import counter
from kombu import Connection, Consumer, Producer, Queue
from kombu.message import Message
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue._handoffs import seal, signature
from kombu_pgqueue._listener import Notified, legacy_token
from kombu_pgqueue._sql import LOCKS
from kombu_pgqueue.records import Outgoing

HOUR = 3600
QUEUE = "payroll-export"
SECRETS = ("payroll", "alice", "123456", "DE89370400440532013000", "iban", "salary", "export")
SENTINEL = "sentinel"


@contextmanager
def _listening(dsn: str, role: str, channel: str) -> Iterator[psycopg.Connection]:
    params = {**conninfo_to_dict(dsn), "user": role}
    with psycopg.connect(make_conninfo(**params), autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        yield conn


def _heard(stranger: psycopg.Connection, db: psycopg.Connection, channel: str) -> list[str]:
    """Every payload so far: a sentinel NOTIFY marks the end (commit order)."""
    db.execute("SELECT pg_notify(%s, %s)", [channel, SENTINEL])
    payloads = []
    for notify in stranger.notifies(timeout=10):
        if notify.payload == SENTINEL:
            return payloads
        payloads.append(notify.payload)
    raise AssertionError(f"the sentinel did not arrive; heard {payloads}")


def _readings(payload: str) -> list[str]:
    """The payload, and each of its parts decoded as base64 where it decodes."""
    found = [payload.lower()]
    for part in payload.split(":"):
        try:
            found.append(base64.b64decode(part + "=" * (-len(part) % 4)).decode("latin-1").lower())
        except (binascii.Error, ValueError):
            pass
    return found


def test_a_role_without_grants_learns_no_body_argument_or_queue_name(
    make_connection: Callable[..., Connection], db: psycopg.Connection, dsn: str, role: str
) -> None:
    """A consumer waits on queue payroll-export (handoff on, the default) while a role
    with no grants LISTENs: a message handed off, and one that only wakes consumers (a
    worker that takes no handoffs), tell the stranger nothing it could read."""
    worker = make_connection(polling_interval=HOUR)
    waker = make_connection(polling_interval=HOUR, handoff=False)
    publisher = make_connection(polling_interval=HOUR)
    channel = worker.transport.options.channel
    got: list[Message] = []
    body = {"employee": "alice", "salary": 123456, "iban": "DE89370400440532013000"}
    with _listening(dsn, role, channel) as stranger:
        with Consumer(worker, [Queue(QUEUE)], callbacks=[lambda b, m: got.append(m)]):
            worker.transport.consumer.deliver_pending(inline=True)  # drained: waits
            before = counter("handoffs", QUEUE)
            Producer(publisher).publish(
                body, routing_key=QUEUE, headers={"argsrepr": "('alice', 123456)"}
            )
            worker.drain_events(timeout=10)
            assert counter("handoffs", QUEUE) == before + 1  # handed off, not claimed
            assert [m.decode() for m in got] == [body]
            got[0].ack()
        with Consumer(waker, [Queue(QUEUE)], callbacks=[lambda b, m: got.append(m)]):
            waker.transport.consumer.deliver_pending(inline=True)
            Producer(publisher).publish(body, routing_key=QUEUE)
            waker.drain_events(timeout=10)
            assert len(got) == 2
            got[1].ack()
        heard = _heard(stranger, db, channel)

    assert [p[:2] for p in heard] == ["h:", "r:"]
    for payload in heard:
        for reading in _readings(payload):
            for secret in SECRETS:
                assert secret.lower() not in reading, (secret, payload)
    # the wakeup's token is not something a guess at the name can confirm
    token = heard[1][2:]
    name = QUEUE.encode()
    assert token not in (
        legacy_token(QUEUE),
        hashlib.sha256(name).hexdigest()[:16],
        hashlib.sha1(name).hexdigest()[:16],
    )


def test_a_role_without_grants_cannot_read_the_key_the_tokens_or_the_waiters(
    connection: Connection, dsn: str, role: str, schema: str
) -> None:
    assert connection.default_channel is not None  # installs the schema
    params = {**conninfo_to_dict(dsn), "user": role}
    with psycopg.connect(make_conninfo(**params), autocommit=True) as stranger:
        for table in ("handoff_key", "queue", "listener"):
            query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(schema, table))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                stranger.execute(query)


def test_a_handoff_replayed_readdressed_or_sealed_with_another_key_is_not_delivered(
    make_connection: Callable[..., Connection], db: psycopg.Connection, dsn: str, role: str
) -> None:
    """A stranger who reads a real handoff may NOTIFY it again, to its consumer or to
    another (whose id it also read): it is not delivered a second time, nor to the other
    (its signature is the first consumer's); nor is one sealed with a key of its own."""
    first = make_connection(polling_interval=HOUR)
    second = make_connection(polling_interval=HOUR)
    publisher = make_connection(polling_interval=HOUR)
    channel = first.transport.options.channel
    got: list[tuple[str, Message]] = []
    with (
        _listening(dsn, role, channel) as stranger,
        Consumer(first, [Queue(QUEUE)], callbacks=[lambda b, m: got.append(("first", m))]),
    ):
        first.transport.consumer.deliver_pending(inline=True)
        Producer(publisher).publish("real", routing_key=QUEUE)
        first.drain_events(timeout=10)
        [real] = _heard(stranger, db, channel)
        listener = first.transport.consumer.wakeups.listener
        assert listener is not None and real.startswith(f"h:{listener.consumer}:")
        with Consumer(second, [Queue(QUEUE)], callbacks=[lambda b, m: got.append(("second", m))]):
            second.transport.consumer.deliver_pending(inline=True)
            other = second.transport.consumer.wakeups.listener
            assert other is not None
            token, rest = listener.watched[QUEUE], real.split(":", 3)[3]
            box = AESGCM(AESGCM.generate_key(bit_length=256))
            outgoing = Outgoing(queue=QUEUE, body=b"own", headers="{}", properties="{}")
            own = f"{token}:1:7:9999999999:{seal(box, outgoing, 7)}"
            for payload in (
                real,  # replayed to its consumer
                "h:" + other.consumer + real[2 + len(listener.consumer) :],  # readdressed
                f"h:{listener.consumer}:{signature(listener.secret, own)}:{own}",
            ):
                db.execute("SELECT pg_notify(%s, %s)", [channel, payload])
            # a real message after them, delivered by claim or handoff to either
            Producer(publisher).publish("after", routing_key=QUEUE)
            while len(got) < 2:
                for conn in (first, second):
                    with contextlib.suppress(socket.timeout, TimeoutError):
                        conn.drain_events(timeout=0.2)

    assert sorted(m.body for _, m in got) == [b"after", b"real"]
    assert rest.count(":") == 4  # token, id, lease, lease end, sealed message


def test_a_wakeup_from_a_publisher_of_the_previous_version_still_wakes(
    connection: Connection,
) -> None:
    """Publishers before migration 0010 name a queue by an MD5 prefix of its name: a
    consumer of this version recognises it during a rolling upgrade (it sends none)."""
    wakeups = Notified({legacy_token(QUEUE): QUEUE, "0123456789abcdef": "other"})
    wakeups.add("r:" + legacy_token(QUEUE))
    assert wakeups.queues == {QUEUE}


def test_a_consumer_of_the_previous_version_is_never_handed_a_sealed_message(
    connection: Connection, store, db: psycopg.Connection, dsn: str, schema: str
) -> None:
    """A worker before migration 0010 registers in table waiter and could not open a
    sealed handoff: a publish of this version wakes it ('r:') instead of leasing the
    message to it, so the message does not wait for a lease to end."""
    store.declare_queue(QUEUE)
    channel = connection.transport.options.channel
    consumer = "00000000000000aa"
    with (
        psycopg.connect(dsn, autocommit=True) as old,
        psycopg.connect(dsn, autocommit=True) as observer,
    ):
        observer.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        # as its LISTEN session does (statements listener_alive and watch of 0009)
        old.execute(
            "SELECT pg_advisory_lock(%s, hashtext(%s::text))", [LOCKS["lock_consumer"], consumer]
        )
        old.execute(
            sql.SQL(
                "INSERT INTO {} (queue, consumer, lease_seconds, secret) VALUES (%s, %s, 60, 's')"
            ).format(sql.Identifier(schema, "waiter")),
            [QUEUE, consumer],
        )
        old.execute(
            "SELECT pg_advisory_lock_shared(%s, hashtext(%s::text || ':' || %s))",
            [LOCKS["lock_waiting"], channel, QUEUE],
        )
        Producer(connection).publish({"n": 1}, routing_key=QUEUE)
        heard = _heard(observer, db, channel)
    assert [p[:2] for p in heard] == ["r:"]
    row = db.execute(
        sql.SQL("SELECT lease, attempts FROM {} WHERE queue = %s").format(
            sql.Identifier(schema, "message_store")
        ),
        [QUEUE],
    ).fetchone()
    assert row == (None, 0)  # ready for any claim
