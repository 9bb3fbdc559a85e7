"""How much a consumer claims at a time: the constants of batching and idleness, and
what the consumer tracks per channel (see ``Consumer.batch_limit``)."""

from __future__ import annotations

from dataclasses import dataclass

from ._ledger import Sink

#: a batch size for consumers that set no prefetch limit
UNLIMITED_BATCH = 100

#: seconds a consumer that still holds messages waits for three quarters of its window
#: to free (see Consumer.batch_limit)
CLAIM_BATCH_WAIT = 0.05

#: a consumer that delivered nothing for this long claims in the event loop's own thread
#: (the loop has nothing else to do): the hops to a claim thread and back came to about
#: a tenth of the time from apply_async to task start on an idle prefork worker
IDLE_INLINE_SECONDS = 0.02


@dataclass(slots=True)
class Subscription:
    """A queue a consumer consumes, and the channel it delivers to."""

    sink: Sink
    no_ack: bool


@dataclass(slots=True)
class SinkState:
    """One channel's claims as its consumer sees them."""

    claiming: int = 0  # messages that claims in flight may still bring
    last_claim: float = 0.0


def batch_limit(sink: Sink, state: SinkState, now: float) -> int:
    """How many messages ``sink`` should claim now (0: not yet), at ``now`` by the
    consumer's clock.

    Within the prefetch window, but not one slot at a time: while the channel still
    holds more than a quarter of its window (and more than one message), it waits
    (CLAIM_BATCH_WAIT at most). A quarter, not half: a prefork -c 2 worker (window
    8) then claims 6 at a time, not 4, and its main process spent 269 instead of 318
    us per no-op task (benchmarks/probes/drain_cpu.py).
    """
    room = sink.room()
    if room is None:
        return UNLIMITED_BATCH
    room -= state.claiming
    if room <= 0:
        return 0
    window = sink.window()
    holding = window - room
    recent = now - state.last_claim < CLAIM_BATCH_WAIT
    if holding > max(1, window // 4) and recent:
        return 0
    return room


def has_room(sink: Sink, state: SinkState) -> bool:
    """Whether ``sink`` may take one more message now, claims in flight counted."""
    room = sink.room()
    return room is None or room - state.claiming > 0
