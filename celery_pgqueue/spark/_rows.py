"""Rows into messages on the executors, and the tally of what each partition did."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from ._messages import MAX_KEY_BYTES, _json, _Template, _uuid5
from ._results import PartitionResult

_SCALARS = frozenset({str, int, float, bool, type(None)})


# -- rows into messages (on the executors) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each part of a message sits in the selected row."""

    names: tuple[str, ...]  # the columns a row holds, in order
    spread: tuple[int, ...]  # where each of names is among the columns Spark sends
    types: tuple[str, ...]  # Spark's type name of each of names
    nargs: int
    kwnames: tuple[str, ...]
    nkeys: int
    priority: int | None
    eta: int | None
    expires: int | None
    convert: tuple[int, ...]  # columns whose values need _plain()
    naive_utc: frozenset[int]  # timestamp columns whose naive values are UTC wall clock


def _plain(value: Any) -> Any:
    """Spark's struct rows as dicts (field names kept), binaries as bytes, maps as dicts."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, tuple) and hasattr(value, "__fields__"):
        return {k: _plain(v) for k, v in zip(value.__fields__, value)}
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _when(value: datetime, naive_utc: bool) -> datetime:
    if value.tzinfo is None:
        # pickled rows hand TIMESTAMP as naive local time; TIMESTAMP_NTZ is naive UTC
        return value.replace(tzinfo=timezone.utc) if naive_utc else value.astimezone(timezone.utc)
    return value.astimezone(timezone.utc)


def _builder(
    template: _Template,
    layout: _Layout,
    *,
    allow_nulls: bool,
    eta: datetime | None,
    expires: datetime | None,
) -> Callable[[Sequence[Any]], tuple[Any, ...] | str]:
    """The per-row function: a row's COPY tuple, or the reason it cannot be sent."""
    names, nargs, kwnames, nkeys = layout.names, layout.nargs, layout.kwnames, layout.nkeys
    nvalues = nargs + len(kwnames)
    convert, naive_utc = layout.convert, layout.naive_utc
    p_at, eta_at, expires_at = layout.priority, layout.eta, layout.expires
    task, default_priority = template.task, template.priority
    body_of, message = template.body, template.message

    def build(row: Sequence[Any]) -> tuple[Any, ...] | str:
        if convert:
            row = list(row)
            for column in convert:
                row[column] = _plain(row[column])
        values = row[:nvalues]
        if not allow_nulls and None in values:
            return f"null in column {names[list(values).index(None)]!r}"
        args = tuple(values[:nargs])
        kwargs = dict(zip(kwnames, values[nargs:])) if kwnames else {}
        try:
            body = body_of(args, kwargs)
        except (TypeError, ValueError) as exc:
            return f"cannot encode the arguments as JSON: {exc}"
        dedup_key = None
        if nkeys:
            keys = row[nvalues : nvalues + nkeys]
            if None in keys:
                return f"null in dedup key column {names[nvalues + list(keys).index(None)]!r}"
            key = keys[0]
            if nkeys == 1 and type(key) is str:
                text = key
            elif nkeys == 1 and type(key) is int:
                text = str(key)
            else:
                try:
                    text = _json(key if nkeys == 1 else list(keys))
                except (TypeError, ValueError) as exc:
                    return f"cannot encode the dedup key: {exc}"
            dedup_key = task + ":" + text
            if "\x00" in text or (
                len(dedup_key) > MAX_KEY_BYTES // 4 and len(dedup_key.encode()) > MAX_KEY_BYTES
            ):
                return f"dedup key has a NUL or is longer than {MAX_KEY_BYTES} bytes"
            task_id = _uuid5(dedup_key)
        else:
            task_id = _uuid5(task + "\x00" + body)
        priority = default_priority
        if p_at is not None and row[p_at] is not None:
            priority = row[p_at]
            if not 0 <= priority <= 255:
                return f"priority {priority} is outside 0-255"
        when = eta
        if eta_at is not None:
            value = row[eta_at]
            when = None if value is None else _when(value, eta_at in naive_utc)
        until = expires
        if expires_at is not None:
            value = row[expires_at]
            until = None if value is None else _when(value, expires_at in naive_utc)
        return message(args, kwargs, body, task_id, dedup_key, priority, when, until)

    return build


class _Tally:
    def __init__(self, partition: int, attempt: int, max_bad_rows: int) -> None:
        self.partition, self.attempt = partition, attempt
        self.rows = self.enqueued = self.bad = 0
        self.bad_rows: list[dict[str, Any]] = []
        self.max_bad_rows = max_bad_rows
        self.copy_seconds = self.insert_seconds = 0.0

    def reject(self, index: int, reason: str, row: Sequence[Any], layout: _Layout) -> None:
        self.bad += 1
        if len(self.bad_rows) < self.max_bad_rows:
            key = row[layout.nargs + len(layout.kwnames)] if layout.nkeys == 1 else None
            self.bad_rows.append(
                {
                    "partition": self.partition,
                    "index": index,
                    "reason": reason,
                    "row": repr(dict(zip(layout.names, row)))[:300],
                    "key": None if key is None else str(key),
                }
            )

    def result(self) -> PartitionResult:
        return PartitionResult(
            partition=self.partition,
            attempt=self.attempt,
            rows=self.rows,
            enqueued=self.enqueued,
            skipped=self.rows - self.bad - self.enqueued,
            bad=self.bad,
            copy_seconds=self.copy_seconds,
            insert_seconds=self.insert_seconds,
        )
