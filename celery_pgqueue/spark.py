"""Spark pipeline: one Celery task per DataFrame row, and the broker read back as DataFrames.

.. code-block:: python

    from celery_pgqueue.spark import enqueue_dataframe
    summary = enqueue_dataframe(
        df, "app.tasks.scrape", args=["url"], dedup_key="url", dsn="postgresql://app@db/app"
    )
    summary.enqueued, summary.skipped, summary.bad_rows, summary.partitions_failed

Each row becomes the message ``apply_async`` would publish (Celery protocol 2, JSON), so
unmodified workers run it. Each Spark partition writes its rows in one transaction through
psycopg, no JDBC: COPY into a staging table, then ``INSERT ... ON CONFLICT (queue, dedup_key)
DO NOTHING`` (the broker's ``copy_staging`` and ``publish_staged`` statements), which wakes
consumers with one NOTIFY per queue at commit. Rows reach Python as Arrow batches when
pyarrow and pandas are installed (``pyspark[sql]``; also what Spark Connect needs), else as
pickled rows.

Idempotent: every row carries a dedup key, ``<task>:<key column>``, or without a key column
``celery:<task id>:0`` with the task id a UUID5 of the task name and arguments. A Spark task
retried after its commit, or a re-run of the job, finds its keys waiting and skips them
(``skipped``). A key is held while its message waits or runs; an acked task frees it.

Bad rows (a null in an argument or key column, a value JSON cannot carry, a priority outside
0-255) are left out and reported with their partition, position and values; they never fail
the job. A partition that raises is retried by Spark (``spark.task.maxFailures``, or F in a
``local[N,F]`` master); its last attempt reports the error in ``partitions_failed`` instead of
failing the job.

:func:`dead_letters_dataframe` and :func:`queue_stats_dataframe` read the broker through
psycopg on the driver into ``spark.createDataFrame``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from functools import cache
from hashlib import sha1
from itertools import repeat
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any, Literal
from uuid import NAMESPACE_URL, uuid5

import psycopg
from kombu.utils import json as kombu_json
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue import _sql, migrations
from kombu_pgqueue._options import Options, parse_options, task_dedup_key
from kombu_pgqueue._store import Outgoing, Store

if TYPE_CHECKING:
    from celery import Celery
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "BadRow",
    "EnqueueSummary",
    "PartitionFailure",
    "PartitionResult",
    "dead_letters_dataframe",
    "enqueue_dataframe",
    "queue_stats_dataframe",
]

log = logging.getLogger(__name__)

#: UUID5 namespace of content-derived task ids; changing it changes every id
NAMESPACE = uuid5(NAMESPACE_URL, "pgqueue:spark")
MAX_KEY_BYTES = 2000  # a dedup-key index entry must fit a third of a page
_SCALARS = frozenset({str, int, float, bool, type(None)})


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
    copy_seconds: float  # reading rows, building messages and streaming them into COPY
    insert_seconds: float  # the INSERT from staging, and the commit


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


# -- JSON and ids, as the factory writes them -------------------------------------------


_NAMESPACE_BYTES = NAMESPACE.bytes
_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # RFC 4122 variant bits


def _uuid5(name: str) -> str:
    """``str(uuid5(NAMESPACE, name))``, at a third of the cost."""
    h = sha1(_NAMESPACE_BYTES + name.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_encode = json.JSONEncoder().encode  # what json.dumps does with no arguments


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps's own C encoder, made once: what json.dumps(value) writes, at half the cost
# (no circular-reference check: values from Spark rows cannot hold a cycle)
_c_encode = (
    c_make_encoder(None, _refuse, encode_basestring_ascii, None, ": ", ", ", False, False, True)
    if c_make_encoder is not None
    else None
)


def _json(value: Any) -> str:
    # as messages.TaskMessageFactory encodes: plain json, else Kombu's types
    try:
        if _c_encode is not None:
            return "".join(_c_encode(value, 0))
        return _encode(value)
    except (TypeError, ValueError):
        return str(kombu_json.dumps(value))


_HEADER_SLOTS = ("id", "root_id", "argsrepr", "kwargsrepr", "eta", "expires")
_PROPERTY_SLOTS = ("correlation_id", "priority", "expiration", "dedup_key")


def _split(text: str, slots: Sequence[str], required: int) -> str:
    """Turn a factory-written JSON object into a ``str.format`` template.

    The value of ``slots[i]`` becomes ``{i}`` wherever the factory put that key; a slot
    the factory did not write stays out. The first ``required`` slots must be there.
    """
    found = json.loads(text)
    if _encode(found) != text:
        raise ValueError(f"the factory's JSON is not plain json.dumps output: {text[:200]}")
    marks = {}
    for position, name in enumerate(slots):
        if name in found:
            marks[position] = found[name] = f"\x00pgq:{name}\x00"
        elif position < required:
            raise ValueError(f"the factory's message has no {name!r}: {text[:200]}")
    template = _encode(found).replace("{", "{{").replace("}", "}}")
    for position, mark in marks.items():
        template = template.replace(_encode(mark), f"{{{position}}}")
    return template


class _Template:
    """Messages for one task, from fixed text around the parts that vary per row.

    Built on the driver from :class:`~celery_pgqueue.messages.TaskMessageFactory` output and
    checked against the factory there, so it writes what the factory (and ``apply_async``)
    writes; it carries only strings, so executors need no Celery app.
    """

    def __init__(
        self, app: Celery, task: str, *, queue: str | None, priority: int | None, keyed: bool
    ) -> None:
        from .messages import TaskMessageFactory

        factory = TaskMessageFactory(app, task, queue=queue, priority=priority)
        self.task = task
        self.queue = factory.queue
        self.priority = factory.priority
        self.keyed = keyed
        self.maxlen = int(app.amqp.argsrepr_maxsize)
        key = "k" if keyed else None
        probe = factory.outgoing([], {}, task_id="probe", dedup_key=key)
        self.embed = json.loads(probe.body)[2]
        self.headers = _split(probe.headers, _HEADER_SLOTS, len(_HEADER_SLOTS))
        self.properties = _split(probe.properties, _PROPERTY_SLOTS, 2)
        past = datetime(2000, 1, 1, tzinfo=timezone.utc)
        probe = factory.outgoing([], {}, task_id="probe", expires=past, dedup_key=key)
        self.expiring_properties = _split(probe.properties, _PROPERTY_SLOTS, 2)
        self._check(factory, app)

    def body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return _json([args, kwargs, self.embed])

    def message(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: str,
        task_id: str,
        dedup_key: str | None,
        priority: int,
        eta: datetime | None,
        expires: datetime | None,
    ) -> tuple[Any, ...]:
        """One COPY row of the staging table (the fields of an Outgoing, in COPY order)."""
        quoted = '"' + task_id + '"'
        maxlen = self.maxlen
        headers = self.headers.format(
            quoted,
            quoted,
            encode_basestring_ascii(repr(args)[:maxlen]),
            encode_basestring_ascii(repr(kwargs)[:maxlen]),
            '"' + eta.isoformat() + '"' if eta else "null",
            '"' + expires.isoformat() + '"' if expires else "null",
        )
        quoted_key = "null" if dedup_key is None else encode_basestring_ascii(dedup_key)
        if expires is None:
            properties = self.properties.format(quoted, priority, None, quoted_key)
        else:
            remaining = (expires - datetime.now(expires.tzinfo)).total_seconds()
            expiration = '"' + str(int(max(remaining, 0) * 1000)) + '"'
            properties = self.expiring_properties.format(quoted, priority, expiration, quoted_key)
        if not self.keyed:
            dedup_key = task_dedup_key(task_id)
        return (
            self.queue,
            priority,
            eta,
            expires,
            dedup_key,
            body.encode(),
            "application/json",
            "utf-8",
            headers,
            properties,
        )

    @staticmethod
    def outgoing(row: tuple[Any, ...]) -> Outgoing:
        keys = ("queue", "priority", "eta", "expires_at", "dedup_key", "body")
        keys += ("content_type", "content_encoding", "headers", "properties")
        return Outgoing(**dict(zip(keys, row)))

    def _check(self, factory: Any, app: Celery) -> None:
        from .messages import TaskMessageFactory

        eta = datetime(2030, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc)
        past = datetime(2001, 1, 1, tzinfo=timezone.utc)
        args: tuple[Any, ...] = ("https://example.com/a b", 1, 2.5, None, True, "\u00e9\x00")
        kwargs = {"n": 3, "tag": "x"}
        key = "k:1" if self.keyed else None
        for priority in (self.priority, 7):
            made = factory
            if priority != self.priority:
                made = TaskMessageFactory(app, self.task, queue=self.queue, priority=priority)
            for expires in (None, past):
                want = made.outgoing(
                    args, kwargs, task_id="id-1", eta=eta, expires=expires, dedup_key=key
                )
                body = self.body(args, kwargs)
                got = self.message(args, kwargs, body, "id-1", key, priority, eta, expires)
                if self.outgoing(got) != want:
                    raise RuntimeError(
                        "celery_pgqueue.spark builds messages that differ from "
                        f"TaskMessageFactory's:\n{self.outgoing(got)}\n{want}"
                    )


# -- rows into messages (on the executors) -----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each part of a message sits in the selected row."""

    names: tuple[str, ...]  # the selected columns, in order
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


#: staging columns in COPY order, with their types in create_staging and for binary COPY
_STAGING = (
    ("queue", "text", "text"),
    ("priority", "smallint", "int2"),
    ("eta", "timestamptz", "timestamptz"),
    ("expires_at", "timestamptz", "timestamptz"),
    ("dedup_key", "text", "text"),
    ("body", "bytea", "bytea"),
    ("content_type", "text", "text"),
    ("content_encoding", "text", "text"),
    ("headers", "text", "text"),
    ("properties", "text", "text"),
)


@cache
def _binary_copy() -> tuple[sql.SQL, list[str]] | None:
    """``copy_staging`` in binary format, if the staging table is still the one known here.

    Binary COPY takes half the client CPU of text and spares the server its parsing: a
    tenth of the whole write path. (A ``copy_staging_binary`` statement in queries.sql
    would own this; until then it is derived from the named statements, and checked.)
    """
    statements = _sql.raw_queries()
    copy = re.fullmatch(
        r"COPY pgqueue_staging \(([^)]*)\) FROM STDIN;?", statements["copy_staging"]
    )
    if copy is None or [c.strip() for c in copy[1].split(",")] != [c[0] for c in _STAGING]:
        return None
    create = statements["create_staging"]
    if not all(re.search(rf"\n\s*{name} {kind},?\n", create) for name, kind, _ in _STAGING):
        return None
    text = statements["copy_staging"].rstrip(";") + " WITH (FORMAT BINARY)"
    return sql.SQL(text), [binary for _, _, binary in _STAGING]  # type: ignore[arg-type]


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


class _Writer:
    """What each Spark partition runs (pickled to the executors; plain strings inside)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def rows_partition(self, partition: int, rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
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

    def _run(self, partition: int, rows: Iterator[Any]) -> dict[str, Any]:
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

    def _write(self, rows: Iterator[Any], tally: _Tally) -> None:
        started = perf_counter()
        messages = self._messages(rows, tally)
        first = next(messages, None)
        if first is None or self.dry_run:
            for _ in messages:
                pass
            tally.copy_seconds = perf_counter() - started
            return
        statements = _sql.queries(self.schema)
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            with conn.transaction():
                conn.execute(statements["create_staging"])
                binary = _binary_copy()
                statement = statements["copy_staging"] if binary is None else binary[0]
                with conn.cursor().copy(statement) as copy:
                    if binary is not None:
                        copy.set_types(binary[1])
                    write = copy.write_row
                    write(first)
                    for message in messages:
                        write(message)
                copied = perf_counter()
                found = conn.execute(
                    statements["publish_staged"], {"channel": self.channel}
                ).fetchall()
        tally.enqueued = int(found[0][0]) if found else 0
        tally.copy_seconds = copied - started
        tally.insert_seconds = perf_counter() - copied

    def _messages(self, rows: Iterator[Any], tally: _Tally) -> Iterator[tuple[Any, ...]]:
        layout: _Layout = self.layout
        build = _builder(
            self.template, layout, allow_nulls=self.allow_nulls, eta=self.eta, expires=self.expires
        )
        index = -1
        try:
            for index, row in enumerate(rows):
                built = build(row)
                if type(built) is str:
                    tally.reject(index, built, row, layout)
                else:
                    yield built
        finally:
            tally.rows = index + 1


# -- the driver ---------------------------------------------------------------------------


def _max_failures(spark: SparkSession) -> int:
    """How many attempts Spark gives a task (local masters ignore spark.task.maxFailures)."""
    master = spark.conf.get("spark.master", "") or ""
    if master.startswith("local") and not master.startswith("local-cluster"):
        found = re.fullmatch(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(found[1]) if found else 1
    return int(spark.conf.get("spark.task.maxFailures", "4") or 4)


def _connection(
    dsn: str, transport_options: Mapping[str, Any] | None, schema: str | None
) -> tuple[str, Options]:
    options = parse_options({**(transport_options or {}), **({"schema": schema} if schema else {})})
    params = dict(options.libpq)
    if "application_name" not in conninfo_to_dict(dsn):
        params.setdefault("application_name", "pgqueue-spark")
    return make_conninfo(dsn, **params), options


def _arrow_available() -> bool:
    try:
        import pandas  # noqa: F401 - Spark's Arrow UDFs need it
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _layout(
    df: DataFrame,
    names: list[str],
    nargs: int,
    kwnames: tuple[str, ...],
    nkeys: int,
    extras: dict[str, str],
    arrow: bool,
) -> tuple[DataFrame, _Layout]:
    from pyspark.sql import functions as F

    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ValueError(f"no such columns in the DataFrame: {missing} (it has {df.columns})")
    quoted = ["`" + n.replace("`", "``") + "`" for n in names]
    selected = df.select(*[F.col(q).alias(f"_{i}") for i, q in enumerate(quoted)])
    types = [field.dataType.typeName() for field in selected.schema.fields]
    first_extra = len(names) - len(extras)
    position = {k: names.index(v, first_extra) for k, v in extras.items()}
    for name in ("eta", "expires"):
        if name in position and types[position[name]] not in ("timestamp", "timestamp_ntz"):
            raise TypeError(f"{name} column {extras[name]!r} must be a timestamp")
    integers = ("byte", "short", "integer", "long")
    if "priority" in position and types[position["priority"]] not in integers:
        raise TypeError(f"priority column {extras['priority']!r} must be an integer")
    nested = ("struct", "array", "map", "binary")
    return selected, _Layout(
        names=tuple(names),
        nargs=nargs,
        kwnames=kwnames,
        nkeys=nkeys,
        priority=position.get("priority"),
        eta=position.get("eta"),
        expires=position.get("expires"),
        # Arrow hands structs and maps as dicts and binaries as bytes already
        convert=() if arrow else tuple(i for i, t in enumerate(types) if t in nested),
        naive_utc=frozenset(
            i for i, t in enumerate(types) if t == "timestamp_ntz" or (arrow and t == "timestamp")
        ),
    )


def enqueue_dataframe(
    df: DataFrame,
    task: str,
    *,
    dsn: str,
    args: Sequence[str] = (),
    kwargs: Sequence[str] | Mapping[str, str] = (),
    queue: str | None = None,
    dedup_key: str | Sequence[str] | None = None,
    priority: int | str | None = None,
    eta: datetime | str | None = None,
    expires: datetime | timedelta | float | str | None = None,
    schema: str | None = None,
    transport_options: Mapping[str, Any] | None = None,
    app: Celery | None = None,
    allow_nulls: bool = False,
    max_bad_rows: int = 1000,
    dry_run: bool = False,
    transfer: Literal["auto", "arrow", "rows"] = "auto",
    after_partition: Callable[[PartitionResult], None] | None = None,
) -> EnqueueSummary:
    """Send one ``task`` message per row of ``df``; return what happened.

    ``args`` and ``kwargs`` name columns (``kwargs`` may map argument names to columns).
    ``dedup_key`` names the column(s) that identify a row's work; without one, the task id
    and key come from the arguments, so identical rows are one task. ``priority``, ``eta``
    and ``expires`` are a value for every row or the name of a column (null: the default).
    ``app`` lends its routing (``task_routes``) and defaults; it must use the JSON serializer.
    ``dsn`` must reach the database from the executors as well as the driver.
    ``dry_run`` builds and checks every message but writes none. ``transfer`` picks how rows
    reach Python ("arrow" needs pyarrow and pandas). ``after_partition`` runs on the executor
    after a partition commits; if it raises, Spark retries the partition.
    """
    from celery import Celery

    started = monotonic()
    conninfo, options = _connection(dsn, transport_options, schema)
    with psycopg.connect(conninfo, autocommit=True) as conn:  # fails here, not on executors
        migrations.ensure(conn, options.schema, auto_migrate=options.auto_migrate)
    arrow = transfer == "arrow" or (transfer == "auto" and _arrow_available())
    kwmap = dict(kwargs) if isinstance(kwargs, Mapping) else {k: k for k in kwargs}
    keys = [dedup_key] if isinstance(dedup_key, str) else list(dedup_key or ())
    extras = {
        k: v
        for k, v in (("priority", priority), ("eta", eta), ("expires", expires))
        if isinstance(v, str)
    }
    names = [*args, *kwmap.values(), *keys, *extras.values()]
    selected, layout = _layout(df, names, len(args), tuple(kwmap), len(keys), extras, arrow)
    if isinstance(expires, (int, float)):
        expires = timedelta(seconds=float(expires))
    if isinstance(expires, timedelta):  # fixed here, so a retried partition writes the same
        expires = datetime.now(timezone.utc) + expires
    template = _Template(
        app or Celery(set_as_current=False),
        task,
        queue=queue,
        priority=priority if isinstance(priority, int) else None,
        keyed=bool(keys),
    )
    spark = df.sparkSession
    writer = _Writer(
        template=template,
        layout=layout,
        conninfo=conninfo,
        schema=options.schema,
        channel=options.channel,
        eta=None if eta is None or isinstance(eta, str) else _when(eta, False),
        expires=None if expires is None or isinstance(expires, str) else _when(expires, False),
        allow_nulls=allow_nulls,
        max_bad_rows=max_bad_rows,
        max_failures=_max_failures(spark),
        dry_run=dry_run,
        after_partition=after_partition,
    )
    with _job_description(spark, f"pgqueue: enqueue {task} into {template.queue!r}"):
        if arrow:
            found = selected.mapInArrow(writer.arrow_partition, "outcome string").collect()
            outcomes = [json.loads(row[0]) for row in found]
        else:
            outcomes = selected.rdd.mapPartitionsWithIndex(writer.rows_partition).collect()
    return _summary(outcomes, max_bad_rows, monotonic() - started)


class _job_description:
    """Names the Spark job in the Spark UI (classic sessions; Spark Connect has no context)."""

    def __init__(self, spark: SparkSession, text: str) -> None:
        try:
            self.context: Any = spark.sparkContext
        except Exception:
            self.context = None
        self.text = text

    def __enter__(self) -> None:
        if self.context is not None:
            self.before = self.context.getLocalProperty("spark.job.description")
            self.context.setJobDescription(self.text)

    def __exit__(self, *exc: object) -> None:
        if self.context is not None:
            self.context.setJobDescription(self.before)


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


# -- the broker read back ----------------------------------------------------------------

_DEAD_LETTER_COLUMNS = (
    "id long, queue string, task string, task_id string, args string, kwargs string, "
    "retries int, reason string, attempts int, priority int, created_at timestamp, "
    "died_at timestamp, content_type string, body string, headers string, properties string"
)


def dead_letters_dataframe(
    spark: SparkSession,
    dsn: str,
    *,
    schema: str | None = None,
    queue: str | None = None,
    limit: int | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """The dead letters (oldest first) as a DataFrame, with the task's name, id and arguments.

    Read through the driver: meant for analysis of up to millions of rows, e.g.
    ``dead_letters_dataframe(spark, dsn).groupBy("task", "reason").count()``.
    """
    conninfo, options = _connection(dsn, transport_options, schema)
    found = Store(conninfo, options).dead_letters(queue, limit if limit is not None else 2**62)
    rows = []
    for dead in found:
        headers = json.loads(dead.headers)
        body = bytes(dead.body)
        try:
            text = body.decode(dead.content_encoding or "utf-8")
        except (UnicodeDecodeError, LookupError):
            text = body.hex()
        rows.append(
            (
                dead.id,
                dead.queue,
                headers.get("task"),
                headers.get("id"),
                headers.get("argsrepr"),
                headers.get("kwargsrepr"),
                headers.get("retries"),
                dead.reason,
                dead.attempts,
                dead.priority,
                dead.created_at,
                dead.died_at,
                dead.content_type,
                text,
                dead.headers,
                dead.properties,
            )
        )
    return spark.createDataFrame(rows, _DEAD_LETTER_COLUMNS)


def queue_stats_dataframe(
    spark: SparkSession,
    dsn: str,
    *,
    schema: str | None = None,
    transport_options: Mapping[str, Any] | None = None,
) -> DataFrame:
    """Per queue: ready, delayed (ETA), leased, dead, and the oldest ready message's age (s)."""
    conninfo, options = _connection(dsn, transport_options, schema)
    stats = Store(conninfo, options).queue_stats()
    return spark.createDataFrame(
        [asdict(s) for s in stats],
        "queue string, ready long, delayed long, leased long, dead long, oldest_ready_age double",
    )
