"""The Consumer: one per transport, the owner of consuming.

Four parts, arrows only downward (docs/architecture.md):
- this Consumer: the subscriptions (queue -> the channel that consumes it, a
  :class:`~._pacing.Sink`), each channel's claims in flight and pacing
  (:mod:`._pacing`), the safety poll and sweep times, and the
  :class:`~._rotation.Rotator`'s thread (started with the first subscription); it hands typed
  :class:`~.records.Delivery` records up through one callable (the transport turns
  them into Kombu's payloads);
- :class:`~._wakeups.Wakeups`: the LISTEN session and what it, the poll and the claims
  say (queues with news, handoffs, due times);
- :class:`~._claimer.Claimer`: claims sent without waiting (an event loop's);
- :class:`~._settler.Settler`: the deliveries held, acked, rejected, released, renewed.

Who writes what: every field here is written by the consuming thread only, through
the methods below (the loop driver, :mod:`._loop`, starts and stops the claimer
through them; ``store`` changes on a failover, :meth:`use_store`). The
transport calls :func:`._loop.drain` (synchronous consuming) or registers a
:class:`~._loop.LoopDriver` with an event loop; Kombu's QoS passes acks, rejects and
restores to the settler by tag.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import _counters
from ._claimer import Claimer
from ._handoffs import late
from ._listener import Listener
from ._options import Options
from ._pacing import Clock, Pacing, Plan, Sink
from ._rotation import Rotator
from ._settler import Settler
from ._store import Store, new_lease
from ._wakeups import Wakeups
from .records import Buried, ClaimRequest, ClaimResult, Delivery

Deliver = Callable[[Delivery], None]


def _from_now(epoch: float | None) -> float | None:
    """Seconds from now until ``epoch`` (a due time, the database's epoch seconds)."""
    return None if epoch is None else epoch - time.time()


logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Subscription:
    """A queue a consumer consumes, and the channel it delivers to."""

    sink: Sink
    no_ack: bool


class Consumer:
    def __init__(
        self,
        store: Store,
        options: Options,
        deliver: Deliver,
        connection_errors: tuple[type[BaseException], ...] = (),
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.options = options
        self._deliver = deliver
        #: a callback that raises one of these lost its connection: not the message's fault
        self._connection_errors = connection_errors
        #: the clock of batching, resuming, idleness and the safety poll (tests move it)
        self.clock = clock or Clock()
        self.settler = Settler(store, options)
        self.wakeups = Wakeups(store.conninfo, options, self.no_ack)
        self.claimer: Claimer | None = None
        self._subs: dict[str, Subscription] = {}
        #: each channel's claims in flight and batches, where each queue's claims start
        self._pacing = Pacing(
            self.clock, slow_claim=options.slow_claim_seconds, resume=options.resume_seconds
        )
        #: queues with a claim in flight
        self._inflight: set[str] = set()
        self._last_delivery = 0.0
        self._next_poll = 0.0
        self._next_sweep = 0.0
        self._rotator = Rotator(lambda: self.store, options.rotate_interval)

    def reopen(self) -> None:
        """The transport connected again (after a close): ack in batches again."""
        self.settler.reopen()

    def use_store(self, store: Store) -> None:
        """Another host after a failover: everything goes to its store from now on."""
        self.store = store
        self.settler.use_store(store)
        self.wakeups.use_store(store.conninfo)

    # -- subscriptions ---------------------------------------------------------------

    def subscribe(self, queue: str, sink: Sink, no_ack: bool) -> None:
        self._subs[queue] = Subscription(sink, no_ack)
        self.wakeups.open(self._subs)
        self.wakeups.watch(queue)
        self.poll_soon()  # its delayed messages' due times
        self.settler.keep_leases()
        if not self.wakeups.relayed:  # the relay's hub rotates for the host
            self._rotator.start()

    def unsubscribe(self, queue: str, sink: Sink) -> None:
        sub = self._subs.get(queue)
        if sub is not None and sub.sink is sink:
            del self._subs[queue]
            self.wakeups.forget(queue)
            if all(other.sink is not sink for other in self._subs.values()):
                self._pacing.drop(sink)  # the channel consumes nothing now

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

    @property
    def pending(self) -> frozenset[str]:
        """Queues with news, not yet claimed from."""
        return frozenset(self.wakeups.pending)

    def notice(self, queue: str) -> None:
        """Claim from ``queue`` at the next chance, as if a publish had said so."""
        self.wakeups.news([queue])

    def resume_position(self, queue: str) -> tuple[int, int, float] | None:
        """(priority, id, until): claims from ``queue`` start after that message until
        then (by :attr:`clock`); None: from the head."""
        return self._pacing.position(queue)

    def claiming(self, sink: Sink) -> int:
        """How many messages claims in flight may still bring ``sink``."""
        return self._pacing.claiming(sink)

    def channels(self) -> int:
        """How many channels this consumer keeps claim state for."""
        return self._pacing.channels()

    # -- claiming ----------------------------------------------------------------------

    def batch_limit(self, sink: Sink) -> int:
        """How many messages ``sink`` should claim now (0: not yet; see _pacing)."""
        return self._pacing.limit(sink)

    def _request(self, queue: str, plan: Plan) -> ClaimRequest:
        self._inflight.add(queue)
        self.wakeups.claim_sent(queue)
        return self.store.claim_request(
            queue, plan.limit, new_lease(), after=plan.after, above=plan.above
        )

    def claimed(self, result: ClaimResult) -> list[Delivery]:
        """What a claim brought, as deliveries; note where the queue resumes."""
        request = result.request
        self._inflight.discard(request.queue)
        self._pacing.note(result)
        for message in result.buried:
            self._said_buried(request.queue, message)
        return [Delivery(request.queue, row, request.lease) for row in result.rows]

    def _said_buried(self, queue: str, message: Buried) -> None:
        """One warning per message a claim moved to the dead letters: nothing else tells
        anyone, and a task that never ran is easy to miss."""
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

    def fetch(self, queue: str, limit: int, no_ack: bool, sink: Sink) -> list[Delivery]:
        """Claim up to ``limit`` messages of ``queue`` here, waiting for the answer."""
        # no flush of pending acks first: an acked message still holds its lease until
        # the ack thread deletes it, so a claim cannot hand it out meanwhile
        plan = self._pacing.plan(queue, sink, limit=limit, above_ok=False)
        assert plan is not None  # a limit given: never put off
        if no_ack:
            return [Delivery(queue, row, 0) for row in self.store.take(queue, limit)]
        return self.claimed(self._run_here(self._request(queue, plan)))

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
        ``idle_inline_seconds`` (the claim is quicker here) unless called from the loop's
        tick callbacks (``in_tick``): Celery's prefork pool writes the tasks handed to
        it in a tick callback of its own, and a task handed over in a later one waits
        for the next tick, after a poll that can sleep until the next timer (2 to 5 s
        in the chaos listenkill scenario); tasks delivered from a reader (the claim's
        answer on a readable socket) are written at once.
        """
        delivered = self._take_handoffs() if self.wakeups.handed else 0
        for queue in list(self.wakeups.pending):
            sub = self._subs.get(queue)
            if sub is None:
                self.wakeups.forget(queue)
                continue
            if queue in self._inflight:
                continue
            sent = (
                self.claimer is not None
                and not inline
                and not sub.no_ack
                and (in_tick or not self._idle())
            )
            plan = self._pacing.plan(queue, sub.sink, sent=sent, above_ok=not sub.no_ack)
            if plan is None:
                continue  # stays pending until the window opens
            if sent:
                assert self.claimer is not None
                self.claimer.submit(self._request(queue, plan))
                continue
            if sub.no_ack:
                self.wakeups.claim_sent(queue)  # news from now on means: take again
                deliveries = [Delivery(queue, r, 0) for r in self.store.take(queue, plan.limit)]
            else:
                deliveries = self.claimed(self._run_here(self._request(queue, plan)))
            # a claim above the position says nothing of the queue's own range
            self._hand_out(queue, plan.limit, deliveries, plan.above)
            delivered += len(deliveries)
        return delivered

    def on_claimed(self) -> None:
        """Deliver what the claims in flight brought (their socket is readable), and
        what claims answered while the listener's statements waited for them."""
        while self.claimer is not None:
            self._claimed_results(self.claimer.results())
            if self.claimer is None or not self.claimer.answered:
                break
        self.deliver_pending()

    def _claimed_results(self, results: list[ClaimResult]) -> None:
        for result in results:
            sub = self._subs.get(result.request.queue)
            self._pacing.answered(None if sub is None else sub.sink, result.request.limit)
        error: BaseException | None = None
        for n, result in enumerate(results):
            queue = result.request.queue
            if result.error is not None:
                self._inflight.discard(queue)
                error = error or result.error  # the queue stays pending: claimed again
                continue
            deliveries = self.claimed(result)
            if error is not None or queue not in self._subs:
                self.settler.release_deliveries(deliveries)  # cancelled meanwhile: back
                continue
            try:
                # a claim above the position says nothing of the queue's own range
                self._hand_out(queue, result.request.limit, deliveries, result.request.above)
            except BaseException:
                for later in results[n + 1 :]:  # the later batches go back too
                    if later.error is None:
                        self.settler.release_deliveries(self.claimed(later))
                    else:
                        self._inflight.discard(later.request.queue)
                raise
        if error is not None:
            raise error

    def _idle(self) -> bool:
        """Nothing claimed, held or delivered lately: claim in the loop's thread."""
        return (
            not self._inflight
            and not self.settler.holding()
            and self.clock() - self._last_delivery >= self.options.idle_inline_seconds
        )

    def _hand_out(self, queue: str, limit: int, deliveries: list[Delivery], part: bool) -> None:
        """Deliver one claim's messages; a callback's error is raised once what it left
        over is released (not leased, unseen and unrenewed, until the lease ends).
        ``part``: the claim read part of the queue (claim_above), which says nothing of
        whether the queue is drained."""
        self._deliver_each(queue, deliveries)
        self._after_claim(queue, limit, len(deliveries), more=part or len(deliveries) >= limit)

    def _deliver_each(self, queue: str, deliveries: list[Delivery]) -> None:
        if deliveries:
            self._last_delivery = self.clock()
        for n, delivery in enumerate(deliveries):  # the queue stays pending if one raises
            try:
                self._deliver(delivery)
            except Exception as exc:
                if self.options.callback_errors == "raise" or isinstance(
                    exc, self._connection_errors
                ):
                    self.settler.release_deliveries(deliveries[n + 1 :])
                    raise
                # dead-lettered, and consuming goes on: no message takes its consumer down
                sub = self._subs.get(queue)
                self.settler.poisoned(delivery, exc, None if sub is None else sub.sink)
            except BaseException:  # the process is exiting: hand the rest back
                self.settler.release_deliveries(deliveries[n + 1 :])
                raise

    def _after_claim(self, queue: str, limit: int, got: int, *, more: bool) -> None:
        """Tell the wakeups what a claim (or a handoff) left: a full window keeps the
        queue pending (claimed again as the window opens), and a queue with a backlog
        is not watched (see Wakeups.after_claim)."""
        sub = self._subs.get(queue)
        if sub is None:
            return
        full = got > 0 and self._pacing.full(sub.sink)
        self.wakeups.after_claim(queue, more=more or full, backlog=full or 1 < limit <= got)

    def _take_handoffs(self) -> int:
        """Deliver what publishes handed off to this consumer as claimed messages; hand
        back at once what it cannot take now: no room in its window (claims in flight
        counted), or the queue not consumed with acks (docs/lifecycle.md, "Wakeups")."""
        now = time.time()
        back: list[Delivery] = []
        taken = 0
        handed = self.wakeups.take_handoffs()
        try:
            while handed:
                queue, handoff = handed.pop(0)
                delivery = Delivery(queue, handoff.row, handoff.lease, handoff=True)
                sub = self._subs.get(queue)
                takes = sub is not None and not sub.no_ack and self._pacing.has_room(sub.sink)
                if not takes or late(handoff, self.options, now):
                    back.append(delivery)
                    _counters.add("handbacks", queue)
                    if sub is not None:
                        self.notice(queue)  # claimed again as its window opens
                    continue
                _counters.add("handoffs", queue)
                self._deliver_each(queue, [delivery])
                taken += 1
                self._after_claim(queue, 1, 1, more=True)  # a window it filled: stop waiting
        finally:
            back.extend(Delivery(q, h.row, h.lease, handoff=True) for q, h in handed)
            self.settler.release_deliveries(back)
        return taken

    def listen(self) -> bool:
        """Open the LISTEN session if it is not (LISTEN off: False)."""
        return self.wakeups.open(self._subs)

    def start_claimer(self) -> int:
        """Send claims without waiting for them from now on (an event loop's); return
        the socket to read their answers from (see :meth:`on_claimed`): the LISTEN
        session's when there is one, which the claims then share (``_claimer``)."""
        listener = self.wakeups.listener
        session = listener.conn if isinstance(listener, Listener) else None
        if session is None or session.closed:
            self.claimer = Claimer(self.store)
        else:
            assert isinstance(listener, Listener)
            self.claimer = Claimer(self.store, session)
            listener.share(self.claimer.settle)
        return self.claimer.fileno()

    def stop_claimer(self) -> None:
        claimer, self.claimer = self.claimer, None
        if isinstance(self.wakeups.listener, Listener):
            self.wakeups.listener.unshare()
        if claimer is not None:
            for result in claimer.close():
                self.settler.release_deliveries(self.claimed(result))
        self._pacing.reset()
        self._inflight.clear()

    # -- the safety poll and sweep -----------------------------------------------------

    @property
    def poll_in(self) -> float:
        """Seconds until the safety poll is due (0 or less: now)."""
        return 0.0 if self._next_poll == 0.0 else self._next_poll - self.clock()

    @property
    def poll_interval(self) -> float:
        """Seconds between two safety polls (see Wakeups.poll_interval)."""
        return self.wakeups.poll_interval

    def poll_soon(self) -> None:
        """Poll at the next chance (a new subscription, a due time that came)."""
        self._next_poll = 0.0

    @property
    def poll_asked(self) -> bool:
        """Whether :meth:`poll_soon` asked for a poll that has not run yet."""
        return self._next_poll == 0.0

    def poll(self) -> float | None:
        """The safety poll: promote due delayed messages and find ready queues.

        A queue already pending is claimed from soon anyway: looking for ready messages
        in it again would only cost a walk over its head. Returns the seconds until a
        delayed message newly noted falls due.
        """
        owned = list(self._subs)
        pending = self.wakeups.pending
        ready, next_due = self.store.poll(owned, check=[q for q in owned if q not in pending])
        self.wakeups.news(ready)
        self.wakeups.due_passed()
        now = self.clock()
        self._next_poll = now + self.wakeups.poll_interval
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_interval
            self.store.sweep()
        return _from_now(self.wakeups.note_due(next_due))

    # -- what a driver asks (_loop): times in seconds from now -----------------------------

    def listening(self) -> int | None:
        """Listen if not listening; the socket that brings news (the LISTEN session's, or
        the host relay's), None without one (LISTEN off, or no session can)."""
        return self.wakeups.fileno() if self.listen() else None

    @property
    def claims_apart(self) -> bool:
        """Whether an event loop sends claims without waiting for them (a claimer,
        ``async_claims``). Not through the host's relay: the claimer's session of its
        own would be a session per idle consumer again; claims go through the pool."""
        return self.options.async_claims and not self.wakeups.relayed

    @property
    def has_news(self) -> bool:
        """Queues to claim from, or handed-off messages to deliver."""
        return bool(self.wakeups.pending) or self.wakeups.handed

    @property
    def due_in(self) -> float | None:
        """Seconds until the next delayed message falls due (None: none known)."""
        return _from_now(self.wakeups.next_due)

    def due_passed(self) -> None:
        """The next due time came (the poll promotes what fell due)."""
        self.wakeups.due_passed()

    def news_socket(self) -> int | None:
        """The socket that brings news now: through the host's relay, another after its
        hub went (the driver watches it, then calls :meth:`release_stale`)."""
        return self.wakeups.fileno()

    def release_stale(self) -> None:
        """The driver watches :meth:`news_socket`: close the socket it watched before."""
        self.wakeups.release_stale()

    def read_news(self) -> float | None:
        """Take what arrived on the news socket; seconds until a new due time, if any."""
        return _from_now(self.wakeups.read())

    def take_new_due(self) -> float | None:
        """Seconds until a due time noted since the driver last asked (outside a read or
        a poll: a watch), if any."""
        return _from_now(self.wakeups.take_new_due())

    def wait_news(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for news (without a socket: sleep)."""
        self.wakeups.wait(timeout)

    # -- shutdown --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop acking, renewing and listening; what is held returns when leases end
        (Kombu's channels restore their unacked messages before this)."""
        handed = self.wakeups.close()  # handed off, undelivered: back at once
        self.settler.release([(handoff.row.id, handoff.lease) for handoff in handed])
        self.settler.close()
        self._rotator.stop()
        self.stop_claimer()
