"""What the broker stores and hands out, as plain records.

:class:`Outgoing` is a message as it is written, :class:`Delivered` one as a claim
hands it out, :class:`DeadLetter` one that was moved aside, :class:`QueueStats` one
queue's counts. They carry strings and bytes only (headers and properties as JSON
text): turning them into Kombu's dicts and back is :mod:`kombu_pgqueue.codec`'s job.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A message as the store writes it."""

    queue: str
    body: bytes
    headers: str
    properties: str
    content_type: str | None = None
    content_encoding: str | None = None
    priority: int = 0
    eta: datetime | None = None
    expires_at: datetime | None = None
    dedup_key: str | None = None

    def row(self) -> tuple[Any, ...]:
        """The message as a staging row, in :data:`STAGING_COLUMNS` order."""
        return (
            self.queue,
            self.priority,
            self.eta,
            self.expires_at,
            self.dedup_key,
            self.body,
            self.content_type,
            self.content_encoding,
            self.headers,
            self.properties,
        )

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "body": self.body,
            "headers": self.headers,
            "properties": self.properties,
            "content_type": self.content_type,
            "content_encoding": self.content_encoding,
            "priority": self.priority,
            "eta": self.eta,
            "expires_at": self.expires_at,
            "dedup_key": self.dedup_key,
        }


@dataclass(frozen=True, slots=True)
class Delivered:
    """A message as a claim hands it out."""

    id: int
    priority: int
    attempts: int
    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: str
    properties: str


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message the consumer hands up to its channel: what a claim (or a handoff)
    brought, leased by ``lease`` (0: taken without ack, nothing to settle)."""

    queue: str
    row: Delivered
    lease: int
    #: handed off by its publish, not claimed
    handoff: bool = False


@dataclass(frozen=True, slots=True)
class Handoff:
    """A message a publish leased to this consumer, as its NOTIFY carried it."""

    #: the queue's token (column ``queue.token``, see ``_wakeups``)
    token: str
    lease: int
    #: when the lease ends (epoch seconds, the server's clock)
    until: float
    row: Delivered


def _header(headers: str, key: str) -> str | None:
    """Header ``key`` of stored headers ``headers`` (JSON text), if it is a string."""
    try:
        found = json.loads(headers).get(key)
    except (ValueError, AttributeError):  # text kept as it came, or not an object
        return None
    return found if isinstance(found, str) else None


@dataclass(frozen=True, slots=True)
class Buried:
    """A message a claim moved to the dead letters instead of handing it out: it had
    had ``max_attempts`` deliveries without an ack (reason max_attempts)."""

    id: int
    priority: int
    #: its deliveries
    attempts: int
    headers: str

    @property
    def task(self) -> str | None:
        """The Celery task name (header ``task``), if it has one."""
        return _header(self.headers, "task")

    @property
    def task_id(self) -> str | None:
        """The Celery task id (header ``id``), if it has one."""
        return _header(self.headers, "id")


@dataclass(frozen=True, slots=True)
class Rotation:
    """What one step of the storage's rotation did (function ``rotate``)."""

    #: a new generation became the current one
    rotated: bool
    #: messages moved forward (out of old generations, or the previous version's table)
    moved: int
    #: generations emptied by TRUNCATE
    emptied: int
    #: emptied generations (and eras left with none) detached and kept for reuse
    recycled: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    queue: str
    priority: int
    attempts: int
    reason: str
    created_at: datetime
    died_at: datetime
    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: str
    properties: str
    #: "Type: message" of the exception a task raised (reason failed) or a consumer's
    #: callback raised on it (consumer_error), or why its body could not be decoded
    #: (undecodable); None otherwise
    error: str | None = None
    #: the traceback of a task that failed (reason failed); None otherwise, and from
    #: the listings that do not read it
    traceback: str | None = None
    #: the Celery task id (header ``id``) of the message; None if it has none. Read from
    #: ``headers`` when not given
    task_id: str | None = None

    def __post_init__(self) -> None:
        if self.task_id is None:
            object.__setattr__(self, "task_id", _header(self.headers, "id"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A task that failed for good, as the process that ran it knows it.

    ``id`` and ``lease`` name the delivery it ran from; ``message`` is its message as
    rebuilt from the task's request, stored when the delivery no longer holds the row
    (an early ack deleted it). ``move``: the worker rejects the message after this
    (no ack follows), so a held row leaves its queue here rather than being copied.
    """

    id: int
    lease: int
    attempts: int
    message: Outgoing
    #: "Type: message"
    error: str
    traceback: str | None = None
    move: bool = False

    def params(self) -> dict[str, Any]:
        return {
            **self.message.params(),
            "id": self.id,
            "lease": self.lease,
            "attempts": self.attempts,
            "error": self.error,
            "traceback": self.traceback,
            "move": self.move,
        }


@dataclass(frozen=True, slots=True)
class QueueStats:
    queue: str
    ready: int
    delayed: int
    leased: int
    dead: int
    oldest_ready_age: float | None


#: The staging table's columns in COPY order, and their types for binary COPY.
STAGING_COLUMNS = (
    ("queue", "text"),
    ("priority", "int2"),
    ("eta", "timestamptz"),
    ("expires_at", "timestamptz"),
    ("dedup_key", "text"),
    ("body", "bytea"),
    ("content_type", "text"),
    ("content_encoding", "text"),
    ("headers", "text"),
    ("properties", "text"),
)


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One claim as the store will run it (see ``Store.claim_request``)."""

    queue: str
    limit: int
    lease: int
    #: "claim" (from the head), "claim_after" (after ``after`` = (priority, id)) or
    #: "claim_above" (the higher priorities than ``after``'s, from their head)
    statement: str
    params: dict[str, Any]
    after: tuple[int, int] | None = None
    above: bool = False


#: the claim statements' columns after a :class:`Delivered`'s: the seconds the statement
#: took in the server (on every row), and whether the row is a message it moved to the
#: dead letters instead of leasing it (those come last, without a body)
_TOOK, _DEAD = 8, 9


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What a claim brought: its rows and time in the server, or the error it met, and
    what it moved to the dead letters instead (``buried``)."""

    request: ClaimRequest
    rows: list[Delivered]
    took: float = 0.0
    error: BaseException | None = None
    buried: tuple[Buried, ...] = ()

    @classmethod
    def from_rows(cls, request: ClaimRequest, rows: Sequence[Sequence[Any]]) -> ClaimResult:
        """The rows of ``request``'s statement (claim, claim_after or claim_above), as
        records: where they are run and waited for (``Store.run_claim``) and where they
        are sent without waiting (``_claimer.Claimer``), so a column is read in one
        place."""
        leased = [Delivered(*row[:_TOOK]) for row in rows if not row[_DEAD]]
        # id, priority, attempts and headers: all that a buried row carries
        buried = tuple(Buried(row[0], row[1], row[2], row[6]) for row in rows if row[_DEAD])
        return cls(request, leased, rows[-1][_TOOK] if rows else 0.0, buried=buried)
