"""A Hypothesis state machine over publish / claim / ack / requeue / renew / reject / expire.

The model is a few dicts; the store is the real schema. After every step: the sizes
and dead letters agree, attempts never went down, and a claim never handed out a
message that a live lease still held. At the end every message is acked,
dead-lettered or expired: nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kombu import Connection
from psycopg import sql

from kombu_pgqueue._store import Outgoing, Store, new_lease

MAX_ATTEMPTS = 3
LEASE = timedelta(seconds=60)
QUEUES = ("a", "b")


@dataclass
class Model:
    queue: str
    priority: int
    attempts: int = 0
    lease: int | None = None
    # None: visible since before the model's clock started (published, requeued)
    visible_at: datetime | None = None
    expires_at: datetime | None = None


def _machine(store: Store, db: psycopg.Connection, schema: str) -> type[RuleBasedStateMachine]:
    ident = sql.Identifier(schema)

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            db.execute(sql.SQL("DELETE FROM {}.message_store").format(ident))
            db.execute(sql.SQL("DELETE FROM {}.dead_letter").format(ident))
            row = db.execute("SELECT now() + interval '10 minutes'").fetchone()
            assert row is not None
            self.now: datetime = row[0]
            self.messages: dict[int, Model] = {}
            self.dead: dict[int, str] = {}
            self.acked: set[int] = set()
            self.expired: set[int] = set()
            self.issued: list[tuple[int, int]] = []
            self.seen_attempts: dict[int, int] = {}

        # -- helpers -----------------------------------------------------------

        def visible(self, m: Model) -> bool:
            return m.visible_at is None or m.visible_at <= self.now

        def holds(self, message_id: int, lease: int) -> bool:
            m = self.messages.get(message_id)
            return m is not None and m.lease == lease

        # -- rules ---------------------------------------------------------------

        @rule(
            queue=st.sampled_from(QUEUES),
            priority=st.integers(0, 3),
            # coarse steps of time, so expiry and lease ends land exactly on the clock
            ttl=st.none() | st.sampled_from([10, 30, 60, 61]),
        )
        def publish(self, queue: str, priority: int, ttl: int | None) -> None:
            expires_at = None if ttl is None else self.now + timedelta(seconds=ttl)
            message_id = store.publish(
                Outgoing(
                    queue=queue,
                    body=b"m",
                    headers="{}",
                    properties="{}",
                    priority=priority,
                    expires_at=expires_at,
                )
            )
            assert message_id is not None
            self.messages[message_id] = Model(queue, priority, expires_at=expires_at)

        @rule(queue=st.sampled_from(QUEUES), limit=st.integers(1, 4))
        def claim(self, queue: str, limit: int) -> None:
            candidates = sorted(
                (
                    (i, m)
                    for i, m in self.messages.items()
                    if m.queue == queue
                    and self.visible(m)
                    and (m.expires_at is None or m.expires_at > self.now)
                ),
                key=lambda pair: (-pair[1].priority, pair[0]),
            )[:limit]
            lease = new_lease()

            claimed = store.claim(queue, limit, lease, now=self.now)

            expected = []
            for message_id, m in candidates:
                if m.attempts >= MAX_ATTEMPTS:
                    del self.messages[message_id]
                    self.dead[message_id] = "max_attempts"
                    continue
                m.attempts += 1
                m.lease = lease
                m.visible_at = self.now + LEASE
                expected.append((message_id, m.attempts))
                self.issued.append((message_id, lease))
            assert [(d.id, d.attempts) for d in claimed] == expected

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def ack(self, data: st.DataObject) -> None:
            message_id, lease = data.draw(st.sampled_from(self.issued))
            expected = self.holds(message_id, lease)

            assert store.ack(message_id, lease) is expected
            if expected:
                del self.messages[message_id]
                self.acked.add(message_id)

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def requeue(self, data: st.DataObject) -> None:
            message_id, lease = data.draw(st.sampled_from(self.issued))
            expected = self.holds(message_id, lease)

            assert store.requeue(message_id, lease) is expected
            if expected:
                self.messages[message_id].lease = None
                self.messages[message_id].visible_at = None

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def reject(self, data: st.DataObject) -> None:
            message_id, lease = data.draw(st.sampled_from(self.issued))
            expected = self.holds(message_id, lease)

            assert store.bury(message_id, lease, "rejected") is expected
            if expected:
                del self.messages[message_id]
                self.dead[message_id] = "rejected"

        @precondition(lambda self: self.issued)
        @rule(data=st.data())
        def renew(self, data: st.DataObject) -> None:
            message_id, lease = data.draw(st.sampled_from(self.issued))
            expected = self.holds(message_id, lease)

            assert store.renew([message_id], [lease], now=self.now) == (
                {message_id} if expected else set()
            )
            if expected:
                self.messages[message_id].visible_at = self.now + LEASE

        @rule(seconds=st.sampled_from([10, 30, 61]))
        def advance(self, seconds: int) -> None:
            self.now += timedelta(seconds=seconds)

        @rule()
        def sweep(self) -> None:
            gone = [
                i
                for i, m in self.messages.items()
                if m.expires_at is not None
                and m.expires_at <= self.now
                and (m.lease is None or self.visible(m))
            ]

            assert store.sweep(now=self.now)["expired_messages"] == len(gone)
            for message_id in gone:
                del self.messages[message_id]
                self.expired.add(message_id)

        # -- invariants ----------------------------------------------------------

        @invariant()
        def sizes_agree(self) -> None:
            for queue in QUEUES:
                waiting = sum(
                    1
                    for m in self.messages.values()
                    if m.queue == queue and (m.lease is None or self.visible(m))
                )
                assert store.size(queue, now=self.now) == waiting

        @invariant()
        def dead_letters_agree(self) -> None:
            assert {d.id: d.reason for d in store.dead_letters(limit=10_000)} == self.dead

        @invariant()
        def attempts_never_decrease(self) -> None:
            found = dict(
                db.execute(
                    sql.SQL("SELECT id, attempts FROM {}.message_store").format(ident)
                ).fetchall()
            )
            assert set(found) == set(self.messages)
            for message_id, attempts in found.items():
                assert attempts >= self.seen_attempts.get(message_id, 0)
                assert attempts == self.messages[message_id].attempts
                self.seen_attempts[message_id] = attempts

        def teardown(self) -> None:
            # drain: every message left must come out and be acked, or die of attempts
            self.now += timedelta(days=1)
            for _ in range(MAX_ATTEMPTS + 2):
                for queue in QUEUES:
                    for delivered in store.claim(queue, 1000, lease := new_lease(), now=self.now):
                        assert store.ack(delivered.id, lease)
                        self.acked.add(delivered.id)
                self.now += LEASE * 2
            store.sweep(now=self.now)
            left = db.execute(
                sql.SQL("SELECT count(*) FROM {}.message_store").format(ident)
            ).fetchone()
            assert left == (0,)
            dead = {d.id for d in store.dead_letters(limit=10_000)}
            assert not (dead & self.acked)

    return StoreMachine


def test_store_state_machine(
    make_connection: Callable[..., Connection], db: psycopg.Connection, schema: str
) -> None:
    store = make_connection(max_attempts=MAX_ATTEMPTS).default_channel.store

    run_state_machine_as_test(
        _machine(store, db, schema),
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
