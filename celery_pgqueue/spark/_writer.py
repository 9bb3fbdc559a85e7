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

from ._columns import _Columns
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
    columns: _Columns | None = None  # Arrow batches built by columns, where the layout allows

    def rows_partition(self, partition: int, rows: Iterable[Any]) -> Iterator[dict[str, Any]]:
        spread = self.layout.spread
        if spread != tuple(range(len(spread))):
            rows = (tuple([row[i] for i in spread]) for row in rows)
        yield self._run(partition, lambda tally: list(self._messages(rows, tally)))

    def arrow_partition(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        batches = self._spread(batches)
        if self.columns is None:
            outcome = self._run(
                partition, lambda tally: list(self._messages(self._arrow_rows(batches), tally))
            )
        else:
            outcome = self._run(partition, lambda tally: self._by_columns(batches, tally))
        yield pa.RecordBatch.from_pylist([{"outcome": json.dumps(outcome)}])

    def _spread(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Batches with a column for each of the layout's names (Spark sends each once)."""
        import pyarrow as pa

        spread = self.layout.spread
        if spread == tuple(range(len(spread))):
            return batches
        names = [f"_{i}" for i in range(len(spread))]
        return (
            pa.RecordBatch.from_arrays([batch.column(i) for i in spread], names=names)
            for batch in batches
        )

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

    def _run(
        self, partition: int, messages: Callable[[_Tally], list[tuple[Any, ...]]]
    ) -> dict[str, Any]:
        from pyspark import TaskContext

        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        tally = _Tally(partition, attempt, self.max_bad_rows)
        error = None
        try:
            self._write(messages, tally)
            if self.after_partition is not None:
                self.after_partition(tally.result())
        except Exception as exc:
            if attempt + 1 < self.max_failures:
                raise  # Spark runs the partition again; the dedup keys make that safe
            error = f"{type(exc).__name__}: {exc}"
        return {"result": asdict(tally.result()), "error": error, "bad_rows": tally.bad_rows}

    def _write(self, build: Callable[[_Tally], list[tuple[Any, ...]]], tally: _Tally) -> None:
        started = perf_counter()
        # built in full first: load_staged may have to send them twice (a taken key
        # sends the direct COPY's rows the staging way)
        messages = build(tally)
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

    def _by_columns(self, batches: Iterator[Any], tally: _Tally) -> list[tuple[Any, ...]]:
        """A partition's messages, whole batches at a time; rows the plan leaves out
        (not plain, or bad) go through the per-row builder."""
        assert self.columns is not None
        messages: list[tuple[Any, ...]] = []
        offset = 0
        for batch in batches:
            built, others = self.columns.build(batch)
            messages += built
            if others:
                rows = self._arrow_rows(iter([batch.take(others)]))
                messages += self._messages(rows, tally, positions=[offset + i for i in others])
            offset += batch.num_rows
        tally.rows = offset
        return messages

    def _messages(
        self, rows: Iterable[Any], tally: _Tally, positions: list[int] | None = None
    ) -> Iterator[tuple[Any, ...]]:
        """Rows built one by one; ``positions`` (the rows' places in the partition) when
        they are some of its rows, else they are all of them, counted into ``tally``."""
        layout = self.layout
        build = _builder(
            self.template, layout, allow_nulls=self.allow_nulls, eta=self.eta, expires=self.expires
        )
        index = -1
        try:
            for index, row in enumerate(rows):
                built = build(row)
                if isinstance(built, str):
                    where = index if positions is None else positions[index]
                    tally.reject(where, built, row, layout)
                else:
                    yield built
        finally:
            if positions is None:
                tally.rows = index + 1
