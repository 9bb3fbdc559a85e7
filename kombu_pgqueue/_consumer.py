"""The consumer: one per transport, the one owner of everything about consuming.

It holds the subscribed queues and the channel (a :class:`~._ledger.Sink`) that
consumes each, the queues with news (pending wakeups), messages handed off to it, the
claims in flight, batch sizes (:mod:`._windows`), where each queue resumes claiming,
the safety-poll, sweep and due times, and the deliveries it holds (:class:`~._ledger.Held`:
renewed, acked, rejected). It delivers through one callable (Kombu's ``_deliver``);
the transport calls ``_loop.drain`` (synchronous consuming) or registers it with an
event loop (:class:`~._loop.LoopDriver`), and passes acks, rejects and restores by tag.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg

from . import _counters, codec
from ._claimer import Claimer
from ._handoffs import Replays, late
from ._ledger import Held, Sink
from ._listener import Listener, Wakeups
from ._options import Options
from ._resume import ResumePositions
from ._store import Store, new_lease
from ._windows import IDLE_INLINE_SECONDS, SinkState, Subscription, batch_limit, has_room
from .exceptions import PgQueueError
from .records import Buried, ClaimRequest, ClaimResult, Handoff

Deliver = Callable[[dict[str, Any], str], None]

logger = logging.getLogger(__name__)


class Consumer:
    def __init__(
        self,
        store: Store,
        options: Options,
        deliver: Deliver,
        connection_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.store = store
        self.options = options
        self._deliver = deliver
        #: a callback that raises one of these lost its connection: not the message's fault
        self._connection_errors = connection_errors
        #: the deliveries held unacked: acks, rejects, restores and lease renewals
        self.held = Held(store, options)
        self.listener: Listener | None = None
        self.claimer: Claimer | None = None
        self._subs: dict[str, Subscription] = {}
        self._sinks: dict[int, SinkState] = {}
        #: queues with news, not yet claimed from
        self.pending: set[str] = set()
        #: messages publishes leased to this consumer, not yet delivered (see wake)
        self.handed: list[Handoff] = []
        self._replays = Replays()
        #: queues with a claim in flight, and those woken meanwhile
        self._inflight: set[str] = set()
        self._renotified: set[str] = set()
        #: queue -> (priority, id, until): where claims resume, see _claimed
        self._resume = ResumePositions()
        self._last_delivery = 0.0
        self.next_due: float | None = None
        self.new_due: float | None = None
        self.next_poll = 0.0
        self._next_sweep = 0.0
        self._next_rotation = 0.0
        self._rotation_failures: set[str] = set()
        #: the clock of batching, resuming and idleness (tests move it)
        self.clock: Callable[[], float] = time.monotonic

    def reopen(self) -> None:
        """The transport connected again (after a close): ack in batches again."""
        self.held.closed = False

    # -- subscriptions ---------------------------------------------------------------

    def subscribe(self, queue: str, sink: Sink, no_ack: bool) -> None:
        self._subs[queue] = Subscription(sink, no_ack)
        self._state(sink)
        listener = self.ensure_listener()
        if listener is not None:  # notified from now on
            (listener.no_ack.add if no_ack else listener.no_ack.discard)(queue)
            self.wake(listener.watch([queue]))
        self.pending.add(queue)
        self.next_poll = 0.0  # its delayed messages' due times
        self.held.keep_leases()

    def unsubscribe(self, queue: str, sink: Sink) -> None:
        sub = self._subs.get(queue)
        if sub is not None and sub.sink is sink:
            del self._subs[queue]
            if self.listener is not None:
                with contextlib.suppress(psycopg.Error):  # a lost session holds nothing
                    self.wake(self.listener.unwatch([queue]))
        self.pending.discard(queue)

    @property
    def consuming(self) -> bool:
        return bool(self._subs)

    def no_ack(self, queue: str) -> bool:
        """Whether ``queue`` is consumed without acks (taken, not leased)."""
        return (sub := self._subs.get(queue)) is not None and sub.no_ack

    @property
    def in_flight(self) -> frozenset[str]:
        """Queues with a claim sent and not yet answered."""
        return frozenset(self._inflight)

    def resume_position(self, queue: str) -> tuple[int, int, float] | None:
        """(priority, id, until): claims from ``queue`` start after that message until
        then (by :attr:`clock`); None: from the head."""
        return self._resume.get(queue)

    def claiming(self, sink: Sink) -> int:
        """How many messages claims in flight may still bring ``sink``."""
        state = self._sinks.get(id(sink))
        return 0 if state is None else state.claiming

    def use_store(self, store: Store) -> None:
        """Another host after a failover: everything goes to its store from now on."""
        self.store = store
        self.held.use_store(store)

    def ensure_listener(self) -> Listener | None:
        if not self.options.listen:
            return None
        if self.listener is None:
            self.listener = Listener(self.store.conninfo, self.options)
        if self.listener.open():
            # a new session: notifications may have been missed since the last one
            self.pending.update(self._subs)
        return self.listener

    # -- claiming ----------------------------------------------------------------------

    def batch_limit(self, sink: Sink) -> int:
        """How many messages ``sink`` should claim now (0: not yet; see _windows)."""
        return batch_limit(sink, self._state(sink), self.clock())

    def _state(self, sink: Sink) -> SinkState:
        return self._sinks.setdefault(id(sink), SinkState())

    def request(self, queue: str, sink: Sink, limit: int, *, above: bool = False) -> ClaimRequest:
        """How to claim from ``queue`` now: from its head, or after its last message, or,
        if ``above`` may be claimed and that is due, its higher priorities (_resume)."""
        now = self._state(sink).last_claim = self.clock()
        after = self._resume.after(queue, now)
        above = above and self._resume.above(queue, now)
        self._inflight.add(queue)
        return self.store.claim_request(queue, limit, new_lease(), after=after, above=above)

    def claimed(self, result: ClaimResult) -> list[dict[str, Any]]:
        """Kombu's payloads of what a claim brought; note where the queue resumes."""
        request, rows = result.request, result.rows
        queue = request.queue
        self._inflight.discard(queue)
        self._resume.note(result, self.clock())
        self._said_buried(queue, result.buried)
        if rows:
            _counters.add("claimed", queue, len(rows))
            _counters.add("redelivered", queue, sum(row.attempts > 1 for row in rows))
        else:
            _counters.add("empty_claims", queue)
        return [codec.payload(row, queue, request.lease) for row in rows]

    def _said_buried(self, queue: str, buried: tuple[Buried, ...]) -> None:
        """One warning per message a claim moved to the dead letters: nothing else tells
        anyone, and a task that never ran is easy to miss."""
        for message in buried:
            task = f" (task {message.task}[{message.task_id}])" if message.task else ""
            deliveries = f"{message.attempts} deliver{'y' if message.attempts == 1 else 'ies'}"
            logger.warning(
                "pgqueue: message %s of queue %r%s moved to the dead letters after %s without "
                "an ack (max_attempts %d: its consumer died or its %gs lease, "
                "visibility_timeout, ran out each time); see it with: celery -A <your app> "
                "pgqueue dead show %s (run it again: celery -A <your app> pgqueue dead requeue %s)",
                message.id,
                queue,
                task,
                deliveries,
                self.options.max_attempts,
                self.options.visibility_timeout,
                message.id,
                message.id,
            )

    def fetch(self, queue: str, limit: int, no_ack: bool, sink: Sink) -> list[dict[str, Any]]:
        """Claim up to ``limit`` messages of ``queue`` here, waiting for the answer."""
        # no flush of pending acks first: an acked message still holds its lease until
        # the ack thread deletes it, so a claim cannot hand it out meanwhile
        if no_ack:
            self._state(sink).last_claim = self.clock()
            return [codec.payload(row, queue, 0) for row in self.store.take(queue, limit)]
        return self.claimed(self._run_here(self.request(queue, sink, limit)))

    def _run_here(self, request: ClaimRequest) -> ClaimResult:
        try:
            return self.store.run_claim(request)
        except BaseException:
            self._inflight.discard(request.queue)
            raise

    def deliver_pending(self, *, inline: bool = False, in_tick: bool = False) -> int:
        """Claim from every queue with news, within each channel's prefetch window.

        With a claimer (an event loop with asynchronous claims), this only sends the
        claims (see :meth:`on_claimed`), except for no-ack queues (a take deletes what
        it hands out), when ``inline``, and when nothing was delivered for
        IDLE_INLINE_SECONDS (the claim is quicker here) unless called from the loop's
        tick callbacks (``in_tick``): Celery's prefork pool writes the tasks handed to
        it in a tick callback of its own, and a task handed over in a later one waits
        for the next tick, after a poll that can sleep until the next timer (2 to 5 s
        in the chaos listenkill scenario); tasks delivered from a reader (the claim's
        answer on a readable socket) are written at once.
        """
        delivered = self._take_handoffs() if self.handed else 0
        for queue in list(self.pending):
            sub = self._subs.get(queue)
            if sub is None:
                self.pending.discard(queue)
                continue
            if queue in self._inflight:
                continue
            limit = self.batch_limit(sub.sink)
            if not limit:
                continue  # stays pending until the window opens
            if (
                self.claimer is not None
                and not inline
                and not sub.no_ack
                and (in_tick or not self._idle(sub.sink))
            ):
                self.claimer.submit(self.request(queue, sub.sink, limit, above=True))
                self._sinks[id(sub.sink)].claiming += limit
                continue
            if sub.no_ack:
                payloads, above = self.fetch(queue, limit, True, sub.sink), False
            else:
                result = self._run_here(self.request(queue, sub.sink, limit, above=True))
                payloads, above = self.claimed(result), result.request.above
            # a claim above the position says nothing of the queue's own range
            error, rest = self._hand_out(queue, limit, payloads, renotified=above)
            if error is not None:
                self.held.release_payloads(rest)
                raise error
            delivered += len(payloads)
        return delivered

    def on_claimed(self) -> None:
        """Deliver what the claims in flight brought (their socket is readable)."""
        if self.claimer is None:
            return
        results = self.claimer.results()
        for result in results:
            sub = self._subs.get(result.request.queue)
            state = self._sinks.get(id(sub.sink)) if sub is not None else None
            if state is not None:
                state.claiming = max(state.claiming - result.request.limit, 0)
        error: BaseException | None = None
        undelivered: list[dict[str, Any]] = []
        for result in results:
            queue, limit = result.request.queue, result.request.limit
            renotified = queue in self._renotified
            self._renotified.discard(queue)
            if result.error is not None:
                self._inflight.discard(queue)
                error = error or result.error  # the queue stays pending: claimed again
                continue
            payloads = self.claimed(result)
            if error is not None or queue not in self._subs:
                undelivered.extend(payloads)  # cancelled meanwhile: back at once
                continue
            # a claim above the position says nothing of the queue's own range
            renotified = renotified or result.request.above
            error, rest = self._hand_out(queue, limit, payloads, renotified)
            undelivered.extend(rest)  # and the later batches, as error is set now
        self.held.release_payloads(undelivered)
        if error is not None:
            raise error
        self.deliver_pending()

    def _idle(self, sink: Sink) -> bool:
        """Nothing claimed, held or delivered lately: claim in the loop's thread."""
        return (
            not self._inflight
            and sink.holding() == 0
            and self.clock() - self._last_delivery >= IDLE_INLINE_SECONDS
        )

    def _hand_out(
        self, queue: str, limit: int, payloads: list[dict[str, Any]], renotified: bool = False
    ) -> tuple[BaseException | None, list[dict[str, Any]]]:
        """Deliver one claim's messages; return a callback's error and what it left over,
        which the caller releases at once (not leased, unseen and unrenewed, until the
        lease ends)."""
        error, rest = self._deliver_each(queue, payloads)
        if error is not None:
            return error, rest
        if len(payloads) < limit and not renotified:
            self.pending.discard(queue)  # drained
        return self._turn(queue, limit, len(payloads))

    def _deliver_each(
        self, queue: str, payloads: list[dict[str, Any]]
    ) -> tuple[BaseException | None, list[dict[str, Any]]]:
        if payloads:
            self._last_delivery = self.clock()
        for n, payload in enumerate(payloads):  # the queue stays pending if one raises
            try:
                self._deliver(payload, queue)
            except Exception as exc:
                if self.options.callback_errors == "raise" or isinstance(
                    exc, self._connection_errors
                ):
                    return exc, payloads[n + 1 :]
                # dead-lettered, and consuming goes on: no message takes its consumer down
                sub = self._subs.get(queue)
                self.held.poisoned(queue, payload, exc, None if sub is None else sub.sink)
            except BaseException as exc:  # the process is exiting: hand the rest back
                return exc, payloads[n + 1 :]
        return None, []

    def _take_handoffs(self) -> int:
        """Deliver what publishes handed off to this consumer as claimed messages; hand
        back at once what it cannot take now: no room in its window (claims in flight
        counted), or the queue not consumed with acks (docs/lifecycle.md, "Wakeups")."""
        now = time.time()
        handed = [handoff for handoff in self.handed if self._replays.first(handoff, now)]
        self.handed = []
        tokens = self.listener.tokens if self.listener is not None else {}
        back: list[tuple[int, int]] = []
        error: BaseException | None = None
        for handoff in handed:
            queue = tokens.get(handoff.token, "")
            sub = self._subs.get(queue)
            takes = sub is not None and not sub.no_ack and has_room(sub.sink, self._state(sub.sink))
            if error is not None or not takes or late(handoff, self.options, now):
                back.append((handoff.row.id, handoff.lease))
                _counters.add("handbacks", queue)
                if sub is not None:
                    self.pending.add(queue)  # claimed again as its window opens
                continue
            _counters.add("handoffs", queue)
            payload = codec.payload(handoff.row, queue, handoff.lease)
            payload["properties"]["delivery_info"]["pgqueue_handoff"] = True
            error, _ = self._deliver_each(queue, [payload])
            if error is None:
                error, _ = self._turn(queue, 1, 1)  # a window it filled: stop waiting
        self.held.release(back)
        if error is not None:
            raise error
        return len(handed) - len(back)

    def _turn(self, queue: str, limit: int, got: int) -> tuple[BaseException | None, list[Any]]:
        """Wait for ``queue`` only while it is drained and there is room for more (see
        Listener.turn): a full claim, or a window this batch filled, leaves it pending."""
        sub = self._subs.get(queue)
        if self.listener is None or sub is None:
            return None, []
        room = sub.sink.room()
        full = got > 0 and room is not None and room - self._state(sub.sink).claiming <= 0
        if full:
            self.pending.add(queue)
        try:
            backlog = full or 1 < limit <= got
            woken = self.listener.turn(queue, backlog=backlog, pending=queue in self.pending)
        except Exception as exc:  # the listening session is lost: reconnect
            return exc, []
        if woken is not None:
            self.wake(woken)
        return None, []

    def stop_claimer(self) -> None:
        claimer, self.claimer = self.claimer, None
        if claimer is not None:
            left = claimer.close()
            for result in left:
                self._said_buried(result.request.queue, result.buried)
            self.held.release([(row.id, r.request.lease) for r in left for row in r.rows])
        for state in self._sinks.values():
            state.claiming = 0
        self._inflight.clear()
        self._renotified.clear()

    # -- wakeups and the safety poll -------------------------------------------------------

    def wake(self, wake: Wakeups) -> float | None:
        """Note what notifications said; return a due time that is new, if any."""
        self.handed.extend(wake.handoffs)
        woken = [queue for queue in wake.queues if queue in self._subs]
        self.pending.update(woken)
        self._renotified.update(q for q in woken if q in self._inflight)
        return self._note_due(wake.due)

    def poll(self) -> float | None:
        """The safety poll: promote due delayed messages and find ready queues.

        A queue already pending is claimed from soon anyway: looking for ready messages
        in it again would only cost a walk over its head. Returns a new due time.
        """
        owned = list(self._subs)
        ready, next_due = self.store.poll(owned, check=[q for q in owned if q not in self.pending])
        self.pending.update(ready)
        # a claim in flight may have started before these became ready
        self._renotified.update(q for q in ready if q in self._inflight)
        self.next_due = None
        now = time.monotonic()
        self.next_poll = now + self.options.polling_interval
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_interval
            self.store.sweep()
        if now >= self._next_rotation:
            self._next_rotation = now + self.options.rotate_interval
            self._rotate()
        return self._note_due(next_due)

    def _rotate(self) -> None:
        """A step of the storage's rotation. It must never stop a worker: a failure
        (a role without the grant on function rotate, a statement timeout) is logged,
        once per kind, and the next step is tried again later."""
        try:
            self.store.rotate()
        except (psycopg.Error, PgQueueError) as exc:
            kind = type(exc).__name__
            if kind not in self._rotation_failures:
                self._rotation_failures.add(kind)
                logger.warning(
                    "pgqueue: the storage's rotation failed (%s: %s); messages are safe, "
                    "but a snapshot held meanwhile keeps space until it succeeds. "
                    "docs/operations.md, 'Vacuum and bloat', says what it needs",
                    kind,
                    exc,
                )

    def _note_due(self, due: float | None) -> float | None:
        if due is None or (self.next_due is not None and self.next_due <= due):
            return None
        self.next_due = self.new_due = due  # new_due: for the loop's timer, see _loop
        return due

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop acking, renewing and listening; what is held returns when leases end
        (Kombu's channels restore their unacked messages before this)."""
        with contextlib.suppress(Exception):  # hand back what was handed off, undelivered
            self.handed.extend(self.listener.drain().handoffs if self.listener else [])
        self.held.release([(handoff.row.id, handoff.lease) for handoff in self.handed])
        self.handed = []
        self.held.close()
        self.stop_claimer()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.pending.clear()
