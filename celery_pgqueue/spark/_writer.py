"""What each Spark partition runs on its executor: rows in, one COPY transaction out."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from itertools import repeat
from time import perf_counter
from typing import Any

import psycopg

from kombu_pgqueue import admin

from ._messages import _Template
from ._results import PartitionResult
from ._rows import _builder, _Layout, _Tally


@dataclass(frozen=True, kw_only=True)
class _Writer:
    """What each Spark partition runs (pickled to the executors; plain strings inside)."""

    template: _Template
    layout: _Layout
    conninfo: str
    schema: str
    eta: datetime | None
    expires: datetime | None
    allow_nulls: bool
    max_bad_rows: int
    max_failures: int
    dry_run: bool
    after_partition: Callable[[PartitionResult], None] | None

    def rows_partition(self, partition: int, rows: Iterable[Any]) -> Iterator[dict[str, Any]]:
        yield self._run(partition, rows)

    def arrow_partition(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        outcome = self._run(partition, self._arrow_rows(batches))
        yield pa.RecordBatch.from_pylist([{"outcome": json.dumps(outcome)}])

    @staticmethod
    def _arrow_rows(batches: Iterator[Any]) -> Iterator[tuple[Any, ...]]:
        for batch in batches:
            if not batch.num_columns:
                yield from repeat((), batch.num_rows)
                continue
            columns = []
            for column in batch.columns:
                try:
                    columns.append(column.to_pylist(maps_as_pydicts="lossy"))
                except TypeError:  # pyarrow < 13: maps as lists of pairs
                    columns.append(column.to_pylist())
            yield from zip(*columns)

    def _run(self, partition: int, rows: Iterable[Any]) -> dict[str, Any]:
        from pyspark import TaskContext

        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        tally = _Tally(partition, attempt, self.max_bad_rows)
        error = None
        try:
            self._write(rows, tally)
            if self.after_partition is not None:
                self.after_partition(tally.result())
        except Exception as exc:
            if attempt + 1 < self.max_failures:
                raise  # Spark runs the partition again; the dedup keys make that safe
            error = f"{type(exc).__name__}: {exc}"
        return {"result": asdict(tally.result()), "error": error, "bad_rows": tally.bad_rows}

    def _write(self, rows: Iterable[Any], tally: _Tally) -> None:
        started = perf_counter()
        # built in full first: load_staged may have to send them twice (a taken key
        # sends the direct COPY's rows the staging way)
        messages = list(self._messages(rows, tally))
        built = perf_counter()
        tally.copy_seconds = built - started
        if not messages or self.dry_run:
            return
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            # ordered=False: ids need not follow the partition's row order, which spares
            # the INSERT a sort of the whole partition; binary COPY halves the client's CPU
            tally.enqueued = admin.load_staged(
                conn, messages, schema=self.schema, ordered=False, binary=True
            )
        tally.insert_seconds = perf_counter() - built

    def _messages(self, rows: Iterable[Any], tally: _Tally) -> Iterator[tuple[Any, ...]]:
        layout = self.layout
        build = _builder(
            self.template, layout, allow_nulls=self.allow_nulls, eta=self.eta, expires=self.expires
        )
        index = -1
        try:
            for index, row in enumerate(rows):
                built = build(row)
                if isinstance(built, str):
                    tally.reject(index, built, row, layout)
                else:
                    yield built
        finally:
            tally.rows = index + 1
