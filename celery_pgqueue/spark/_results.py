"""What enqueue_dataframe reports: per partition, per bad row, and in all."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class BadRow:
    partition: int
    index: int  # position within its partition
    reason: str
    row: str  # the row's selected columns, cut at 300 characters
    key: str | None = None  # its dedup key column, when it had one


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionResult:
    """One partition's attempt, as ``after_partition`` sees it once it has committed."""

    partition: int
    attempt: int
    rows: int
    enqueued: int
    skipped: int
    bad: int
    copy_seconds: float  # reading rows and building messages
    insert_seconds: float  # COPY (and the INSERT from staging, if needed) and the commit


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionFailure:
    partition: int
    attempts: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueSummary:
    rows: int
    enqueued: int
    skipped: int  # dedup key already waiting or running (earlier run, or earlier attempt)
    bad: int
    bad_rows: tuple[BadRow, ...]  # at most max_bad_rows of them
    partitions: int
    partitions_failed: tuple[PartitionFailure, ...]  # gave up after Spark's retries
    partitions_retried: dict[int, int]  # partition -> failed attempts before it succeeded
    seconds: float
    copy_seconds: float = 0.0  # summed over partitions
    insert_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.partitions_failed


def _summary(outcomes: list[dict[str, Any]], max_bad_rows: int, seconds: float) -> EnqueueSummary:
    parts = [PartitionResult(**o["result"]) for o in outcomes]
    bad_rows = [BadRow(**bad) for o in outcomes for bad in o["bad_rows"]][:max_bad_rows]
    failed = tuple(
        PartitionFailure(partition=p.partition, attempts=p.attempt + 1, error=o["error"])
        for p, o in zip(parts, outcomes)
        if o["error"] is not None
    )
    for failure in failed:
        log.error("pgqueue: partition %d failed %d times: %s", *asdict(failure).values())
    return EnqueueSummary(
        rows=sum(p.rows for p in parts),
        enqueued=sum(p.enqueued for p in parts),
        skipped=sum(p.skipped for p in parts),
        bad=sum(p.bad for p in parts),
        bad_rows=tuple(bad_rows),
        partitions=len(parts),
        partitions_failed=failed,
        partitions_retried={
            p.partition: p.attempt for p, o in zip(parts, outcomes) if p.attempt and not o["error"]
        },
        seconds=seconds,
        copy_seconds=sum(p.copy_seconds for p in parts),
        insert_seconds=sum(p.insert_seconds for p in parts),
    )
