"""The storage's rotation: when it turns (its policy), what this process knows of the
generations (its state), and the thread that runs it beside a consumer.

Messages live in generations, partitions of ``message_store`` (docs/operations.md,
"Vacuum and bloat", says why). A round of the rotation (:func:`rotate`) is four steps,
each statement ``rotate_step`` (function ``rotate``, which runs ``rotate_<step>``,
migration 0016) and a transaction of its own: ``move`` (a new generation when one is
due; what would keep an old one alive moves forward), ``drain`` (a generation that holds
nothing is skipped from then on: the floor moves), ``empty`` (TRUNCATE, once no snapshot
older than the drain is held) and ``recycle`` (emptied generations, and eras left with
none, detached and kept as spares). Each step takes an advisory lock, so the threads of
several consumers, in one process or many, take turns and never do the same step twice;
a step that finds it taken returns at once.

The policy, in one place: :class:`Policy` (when a generation is due, how much one step
does), from the transport options ``rotate_interval``, ``generation_max_age``,
``generation_max_bytes`` and ``generation_dead_rows`` and the constants below; the
function itself waits :data:`STEP_LOCK_TIMEOUT` at most for a lock and closes an era a
reader has held for :data:`READER_HOLD_SECONDS`.

The state: :class:`Generations`, one per store, read by whichever thread's statement
finds it old (statement ``generation_floor``, :meth:`._connected.Connected.rows`).

The thread: :class:`Rotator`, started by the consumer with its first subscription. A
round is four statements or more, and under a ``pg_dump`` each of its lock attempts may
wait out its lock timeout; on the consuming thread it held up the first delivery of
every consumer that started (about 8 ms on this project's machine) and stalled a
worker's event loop once every ``rotate_interval`` while a reader held a generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg

from ._options import Options
from ._periodic import Periodic
from .exceptions import PgQueueError
from .records import Rotation

logger = logging.getLogger(__name__)

#: messages one step moves at most, per generation
ROTATION_BATCH = 10_000
#: generations (partitions) there may be at once; no new one starts while there are as
#: many. A reader keeps the generations of its own era only (migration 0014), so this
#: is a bound that readers in turn, each locking the next era, would reach
MAX_GENERATIONS = 64
#: seconds between two reads of the floor and the current generation (Generations)
FLOOR_READ_SECONDS = 5.0
#: seconds every lock a step asks for is waited on at most (function rotate sets
#: lock_timeout), so that claims and publishes never queue behind a rotation that
#: queues behind a reader. Written in the function (migration 0016): a change takes a
#: migration (tests/db/test_rotation.py holds the two together)
STEP_LOCK_TIMEOUT = 0.020
#: seconds a reader may keep emptied generations from being recycled before their era
#: is closed, when this role may not see since when it has held it (function
#: rotate_recycle, migration 0016, as STEP_LOCK_TIMEOUT)
READER_HOLD_SECONDS = 60.0


class CurrentGeneration:
    """The current generation as this process last read it (statement
    generation_floor), and whether a snapshot held while it filled has ended.

    While another session holds a snapshot (pg_dump, a long query, a standby's
    feedback), VACUUM removes none of the rows acked since, and the generation grows
    with them. When the snapshot ends, VACUUM makes them free space, which the dead
    rows' count no longer shows: the generation would keep its size until its age
    rotates it. So a VACUUM after which at least a tenth of ``generation_dead_rows``
    rows are dead marks it ``held``, and a later one after which under a quarter of the
    most seen then are dead asks for two rotations at the shortest interval
    (:attr:`rotations_due`): the first makes it the previous generation, the second an
    older one, which the rotation empties once it holds nothing.

    The count is read after the VACUUM, so it also holds the rows acked since it ended
    (up to a few seconds' worth): a generation of a busy queue may be taken as held
    when it was not, and then rotated sooner than its age says, nothing worse; the
    quarter of the peak leaves room for the acks of a busy queue after a VACUUM that
    did remove the held rows.

    Who writes what: :meth:`note`, under the lock of the :class:`Generations` that
    holds it.
    """

    def __init__(self, dead_limit: int) -> None:
        self._held_rows = max(dead_limit // 10, 1)
        self.gen = self.size = self.vacuums = 0
        #: the most dead rows seen after a VACUUM while held (0: not held)
        self.held = 0
        #: rotations to take as soon as rotate_interval allows (see Policy)
        self.rotations_due = 0

    def note(self, gen: int, size: int, dead: int, vacuums: int) -> None:
        if gen != self.gen:
            if self.gen and self.rotations_due:
                self.rotations_due -= 1
            self.gen, self.held = gen, 0
        elif vacuums != self.vacuums:
            # a VACUUM ended since the last read: what is dead now, it could not remove
            # (or was acked since it ended)
            if dead >= max(self._held_rows, self.held // 4):
                self.held = max(self.held, dead)
            elif self.held:
                self.held, self.rotations_due = 0, 2
        self.size, self.vacuums = size, vacuums


class Generations:
    """What one store's process knows of the storage's generations, as statement
    generation_floor last read them: the floor, and the current generation.

    Who writes what: :meth:`note` and :meth:`reading`, by whichever thread reads them
    (a statement that takes the floor and finds it older than FLOOR_READ_SECONDS: the
    consuming thread, the lease keeper, the ack batcher; the rotation's thread after
    each round; a pipelined publish), the values under the lock.
    """

    def __init__(self, dead_limit: int) -> None:
        self._lock = threading.Lock()
        #: The oldest generation that may hold a message (0: all of them): statements on
        #: messages take it as ``%(floor)s`` and skip the generations before it without
        #: opening them (see the top of sql/queries.sql). It only grows, so a value read
        #: a few seconds ago is safe; statements sent through Connected.rows read it
        #: again when it is stale, those sent otherwise (the loop's claims, pipelined
        #: publishes) take the value read last.
        self.floor = 0
        self.current = CurrentGeneration(dead_limit)
        self._read_at = -FLOOR_READ_SECONDS

    def stale(self) -> bool:
        """Whether FLOOR_READ_SECONDS have passed since the last read."""
        return time.monotonic() - self._read_at >= FLOOR_READ_SECONDS

    def reading(self) -> None:
        """A read starts: the next is FLOOR_READ_SECONDS away, whether this one
        succeeds or not."""
        self._read_at = time.monotonic()

    def note(self, row: tuple[Any, ...] | None) -> None:
        """What statement generation_floor returned (no row: nothing to note)."""
        if row is not None:
            with self._lock:
                self.floor = max(self.floor, int(row[0]))
                self.current.note(*(int(v or 0) for v in row[1:5]))
        self._read_at = time.monotonic()


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """When a step starts a generation and how much it does: function rotate's
    arguments (migration 0016 says how each is used)."""

    #: a new generation once the current one is this old (seconds)
    max_age: float
    #: ... or this old and holding dead_limit dead rows that VACUUM could not remove
    min_age: float
    dead_limit: int
    #: messages one step moves at most, per generation
    batch: int
    max_generations: int

    @classmethod
    def now(cls, options: Options, current: CurrentGeneration) -> Policy:
        # grown past its size, or a snapshot held while it filled has ended (VACUUM made
        # its dead rows free space, which the dead rows' count no longer shows:
        # CurrentGeneration): the next generation starts now, and this one's space
        # comes back when it drains
        oversized = current.size > options.generation_max_bytes or current.rotations_due > 0
        return cls(
            max_age=options.rotate_interval if oversized else options.generation_max_age,
            min_age=options.rotate_interval,
            dead_limit=options.generation_dead_rows,
            batch=ROTATION_BATCH,
            max_generations=MAX_GENERATIONS,
        )


class Rotating(Protocol):
    """What the rotation needs of a store (:class:`._store.Store` is one)."""

    @property
    def options(self) -> Options: ...

    @property
    def generations(self) -> Generations: ...

    def rotate_step(self, step: str, policy: Policy) -> Rotation: ...

    def read_floor(self, *, now: bool = False) -> None: ...


def rotate(store: Rotating) -> Rotation:
    """One round of the rotation on ``store``: its steps in turn, then the floor read
    again (the drain step may have moved it). Returns what the round did in all."""
    policy = Policy.now(store.options, store.generations.current)

    def repeated(step: str) -> tuple[int, int]:
        """The step again while it did something (drained or emptied one generation,
        recycled one era's generations or the eras left with none; function rotate
        returns a drain in column emptied): the messages it moved, and what it did in
        all."""
        moved = did = 0
        for _ in range(MAX_GENERATIONS):
            taken = store.rotate_step(step, policy)
            moved += taken.moved
            if not (taken.emptied or taken.recycled):
                break
            did += taken.emptied + taken.recycled
        return moved, did

    done = store.rotate_step("move", policy)
    drained_moved, _ = repeated("drain")
    emptied_moved, emptied = repeated("empty")
    _, recycled = repeated("recycle")
    store.read_floor(now=True)
    return Rotation(done.rotated, done.moved + drained_moved + emptied_moved, emptied, recycled)


class Rotator:
    """Runs a round (:func:`rotate`) on ``store()`` at once when started, then every
    ``interval`` seconds, until stopped. ``store`` is a callable: after a failover the
    consumer's store is another one (:meth:`._consumer.Consumer.use_store`).

    Who writes what: :meth:`start` and :meth:`stop` (the consuming thread) the thread;
    the rotation thread the kinds of failure logged.
    """

    def __init__(self, store: Callable[[], Rotating], interval: float) -> None:
        self._store = store
        self._failures: set[str] = set()
        self._thread = Periodic("pgqueue-rotator", interval, self.step, at_once=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def step(self) -> None:
        """One round. It must never stop a worker: a failure (a role without the grant
        on function rotate, a statement timeout, the database away) is logged once per
        kind, with its traceback when it is not the database's, and the next round
        tries again."""
        try:
            rotate(self._store())
        except Exception as exc:  # noqa: BLE001 - the thread must outlive any failure
            kind = type(exc).__name__
            if kind not in self._failures:
                self._failures.add(kind)
                logger.warning(
                    "pgqueue: the storage's rotation failed (%s: %s); messages are safe, "
                    "but a snapshot held meanwhile keeps space until it succeeds. "
                    "docs/operations.md, 'Vacuum and bloat', says what it needs",
                    kind,
                    exc,
                    exc_info=not isinstance(exc, (psycopg.Error, PgQueueError)),
                )
