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
consumers with one NOTIFY per queue at commit.

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
from hashlib import sha1
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any
from uuid import NAMESPACE_URL, uuid5

import psycopg
from kombu.utils import json as kombu_json
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue import _sql, migrations
from kombu_pgqueue._options import parse_options, task_dedup_key
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
    copy_seconds: float  # building messages and streaming them into COPY
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


def _uuid5(name: str) -> str:
    """``str(uuid5(NAMESPACE, name))``, at a third of the cost."""
    h = sha1(NAMESPACE.bytes + name.encode()).hexdigest()
    variant = "89ab"[int(h[16], 16) & 3]
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{variant}{h[17:20]}-{h[20:32]}"


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


def _plain(value: Any) -> Any:
    """Spark's struct rows as dicts (their field names kept) and binaries as bytes."""
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
        self,
        app: Celery,
        task: str,
        *,
        queue: str | None,
        priority: int | None,
        keyed: bool,
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
        quoted_key = encode_basestring_ascii(dedup_key) if dedup_key is not None else "null"
        maxlen = self.maxlen
        headers = self.headers.format(
            quoted,
            quoted,
            encode_basestring_ascii(repr(args)[:maxlen]),
            encode_basestring_ascii(repr(kwargs)[:maxlen]),
            '"' + eta.isoformat() + '"' if eta else "null",
            '"' + expires.isoformat() + '"' if expires else "null",
        )
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

    def body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return _json([args, kwargs, self.embed])

    def outgoing(self, row: tuple[Any, ...]) -> Outgoing:
        keys = ("queue", "priority", "eta", "expires_at", "dedup_key", "body")
        keys += ("content_type", "content_encoding", "headers", "properties")
        return Outgoing(**dict(zip(keys, row)))

    def _check(self, factory: Any, app: Celery) -> None:
        from .messages import TaskMessageFactory

        eta = datetime(2030, 1, 2, 3, 4, 5, 678, tzinfo=timezone.utc)
        past = datetime(2001, 1, 1, tzinfo=timezone.utc)
        args: tuple[Any, ...] = ("https://example.com/a b", 1, 2.5, None, True, "\u00e9\u0000")
        kwargs = {"n": 3, "tag": "x"}
        for priority in (self.priority, 7):
            made = factory
            if priority != self.priority:
                made = TaskMessageFactory(app, self.task, queue=self.queue, priority=priority)
            for expires in (None, past):
                key = "k:1" if self.keyed else None
                want = made.outgoing(
                    args, kwargs, task_id="id-1", eta=eta, expires=expires, dedup_key=key
                )
                got = self.outgoing(
                    self.message(
                        args, kwargs, self.body(args, kwargs), "id-1", key, priority, eta, expires
                    )
                )
                if got != want:
                    raise RuntimeError(
                        "celery_pgqueue.spark builds messages that differ from "
                        f"TaskMessageFactory's:\n{got}\n{want}"
                    )


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
    convert: tuple[int, ...]  # columns of structs, arrays, maps, binaries
    naive_utc: frozenset[int]  # TIMESTAMP_NTZ columns: wall-clock UTC


class _Tally:
    def __init__(self, partition: int, max_bad_rows: int) -> None:
        self.partition = partition
        self.rows = self.good = self.enqueued = self.bad = 0
        self.bad_rows: list[dict[str, Any]] = []
        self.max_bad_rows = max_bad_rows
        self.copy_seconds = self.insert_seconds = 0.0

    def reject(self, index: int, reason: str, row: Sequence[Any], layout: _Layout) -> None:
        self.bad += 1
        if len(self.bad_rows) < self.max_bad_rows:
            k0 = layout.nargs + len(layout.kwnames)
            key = row[k0] if layout.nkeys == 1 else None
            self.bad_rows.append(
                {
                    "partition": self.partition,
                    "index": index,
                    "reason": reason,
                    "row": repr(dict(zip(layout.names, row)))[:300],
                    "key": None if key is None else str(key),
                }
            )

    def result(self, attempt: int) -> PartitionResult:
        return PartitionResult(
            partition=self.partition,
            attempt=attempt,
            rows=self.rows,
            enqueued=self.enqueued,
            skipped=self.good - self.enqueued,
            bad=self.bad,
            copy_seconds=self.copy_seconds,
            insert_seconds=self.insert_seconds,
        )


def _when(value: datetime, naive_utc: bool) -> datetime:
    if value.tzinfo is not None:
        return value
    # PySpark hands TIMESTAMP as naive local time, TIMESTAMP_NTZ as naive wall clock
    return value.replace(tzinfo=timezone.utc) if naive_utc else value.astimezone(timezone.utc)


class _Writer:
    """The function each Spark partition runs (pickled to the executors)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __call__(self, partition: int, rows: Iterator[Any]) -> Iterator[tuple[Any, ...]]:
        from pyspark import TaskContext

        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        tally = _Tally(partition, self.max_bad_rows)
        error = None
        try:
            self._write(rows, tally)
            if self.after_partition is not None:
                self.after_partition(tally.result(attempt))
        except Exception as exc:
            if attempt + 1 < self.max_failures:
                raise  # Spark runs the partition again; the dedup keys make that safe
            error = f"{type(exc).__name__}: {exc}"
        yield asdict(tally.result(attempt)), error, tally.bad_rows

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
                with conn.cursor().copy(statements["copy_staging"]) as copy:
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
        for index, row in enumerate(rows):
            tally.rows += 1
            built = self._build(row, layout)
            if type(built) is str:
                tally.reject(index, built, row, layout)
            else:
                tally.good += 1
                yield built

    def _build(self, row: Any, layout: _Layout) -> tuple[Any, ...] | str:
        """The row's COPY tuple, or why the row cannot be sent."""
        template: _Template = self.template
        if layout.convert:
            row = list(row)
            for column in layout.convert:
                row[column] = _plain(row[column])
        nargs, nkw = layout.nargs, len(layout.kwnames)
        values = row[: nargs + nkw]
        if not self.allow_nulls and None in values:
            return f"null in column {layout.names[list(values).index(None)]!r}"
        args = tuple(values[:nargs])
        kwargs = dict(zip(layout.kwnames, values[nargs:]))
        try:
            body = template.body(args, kwargs)
        except (TypeError, ValueError) as exc:
            return f"cannot encode the arguments as JSON: {exc}"
        if layout.nkeys:
            keys = row[nargs + nkw : nargs + nkw + layout.nkeys]
            if None in keys:
                column = layout.names[nargs + nkw + list(keys).index(None)]
                return f"null in dedup key column {column!r}"
            key = keys[0] if layout.nkeys == 1 else None
            if type(key) is str:
                text = key
            elif type(key) is int:
                text = str(key)
            else:
                try:
                    text = _json(key if layout.nkeys == 1 else list(keys))
                except (TypeError, ValueError) as exc:
                    return f"cannot encode the dedup key: {exc}"
            dedup_key: str | None = template.task + ":" + text
            if "\x00" in text or len(dedup_key.encode()) > MAX_KEY_BYTES:
                return f"dedup key has a NUL or is longer than {MAX_KEY_BYTES} bytes"
            task_id = _uuid5(dedup_key)
        else:
            dedup_key = None
            task_id = _uuid5(template.task + "\x00" + body)
        priority = template.priority
        if layout.priority is not None and row[layout.priority] is not None:
            priority = row[layout.priority]
            if not 0 <= priority <= 255:
                return f"priority {priority} is outside 0-255"
        eta = self.eta
        if layout.eta is not None:
            value = row[layout.eta]
            eta = None if value is None else _when(value, layout.eta in layout.naive_utc)
        expires = self.expires
        if layout.expires is not None:
            value = row[layout.expires]
            expires = None if value is None else _when(value, layout.expires in layout.naive_utc)
        return template.message(args, kwargs, body, task_id, dedup_key, priority, eta, expires)


def _max_failures(spark: SparkSession) -> int:
    """How many attempts Spark gives a task (local masters ignore spark.task.maxFailures)."""
    master = spark.sparkContext.master
    if master.startswith("local") and not master.startswith("local-cluster"):
        found = re.fullmatch(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(found[1]) if found else 1
    return int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4"))


def _connection(dsn: str, transport_options: Mapping[str, Any] | None, schema: str | None):
    options = parse_options({**(transport_options or {}), **({"schema": schema} if schema else {})})
    params = dict(options.libpq)
    if "application_name" not in conninfo_to_dict(dsn):
        params.setdefault("application_name", "pgqueue-spark")
    return make_conninfo(dsn, **params), options


def _column(name: str) -> Any:
    from pyspark.sql import functions as F

    return F.col("`" + name.replace("`", "``") + "`")


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
    after_partition: Callable[[PartitionResult], None] | None = None,
) -> EnqueueSummary:
    """Send one ``task`` message per row of ``df``; return what happened.

    ``args`` and ``kwargs`` name columns (``kwargs`` may map argument names to columns).
    ``dedup_key`` names the column(s) that identify a row's work; without one, the task id
    and key come from the arguments, so identical rows are one task. ``priority``, ``eta``
    and ``expires`` are a value for every row or the name of a column (null: the default).
    ``app`` lends its routing (``task_routes``) and defaults; it must use the JSON serializer.
    ``dsn`` must reach the database from the executors as well as the driver.
    ``dry_run`` builds and checks every message but writes none. ``after_partition`` runs on
    the executor after a partition commits; if it raises, Spark retries the partition.
    """
    from celery import Celery

    started = monotonic()
    spark = df.sparkSession
    conninfo, options = _connection(dsn, transport_options, schema)
    with psycopg.connect(conninfo, autocommit=True) as conn:  # fails here, not on executors
        migrations.ensure(conn, options.schema, auto_migrate=options.auto_migrate)
    kwmap = dict(kwargs) if isinstance(kwargs, Mapping) else {k: k for k in kwargs}
    keys = [dedup_key] if isinstance(dedup_key, str) else list(dedup_key or ())
    names = [*args, *kwmap.values(), *keys]
    extras = {"priority": priority, "eta": eta, "expires": expires}
    extras = {k: v for k, v in extras.items() if isinstance(v, str)}
    names += extras.values()
    missing = [n for n in names if n not in df.columns]
    if missing:
        raise ValueError(f"no such columns in the DataFrame: {missing} (it has {df.columns})")
    selected = df.select(*[_column(n).alias(f"_{i}") for i, n in enumerate(names)])
    types = [field.dataType.typeName() for field in selected.schema.fields]
    position = {k: names.index(v, len(names) - len(extras)) for k, v in extras.items()}
    for name in ("eta", "expires"):
        if name in position and types[position[name]] not in ("timestamp", "timestamp_ntz"):
            raise TypeError(f"{name} column {extras[name]!r} must be a timestamp")
    if "priority" in position and types[position["priority"]] not in (
        "byte",
        "short",
        "integer",
        "long",
    ):
        raise TypeError(f"priority column {extras['priority']!r} must be an integer")
    if isinstance(expires, (int, float)):
        expires = timedelta(seconds=float(expires))
    if isinstance(expires, timedelta):  # fixed here, so a retried partition writes the same
        expires = datetime.now(timezone.utc) + expires
    layout = _Layout(
        names=tuple(names),
        nargs=len(args),
        kwnames=tuple(kwmap),
        nkeys=len(keys),
        priority=position.get("priority"),
        eta=position.get("eta"),
        expires=position.get("expires"),
        convert=tuple(i for i, t in enumerate(types) if t in ("struct", "array", "map", "binary")),
        naive_utc=frozenset(i for i, t in enumerate(types) if t == "timestamp_ntz"),
    )
    template = _Template(
        app or Celery(set_as_current=False),
        task,
        queue=queue,
        priority=priority if isinstance(priority, int) else None,
        keyed=bool(keys),
    )
    writer = _Writer(
        template=template,
        layout=layout,
        conninfo=conninfo,
        schema=options.schema,
        channel=options.channel,
        eta=None if isinstance(eta, str) or eta is None else _when(eta, False),
        expires=None if isinstance(expires, str) or expires is None else _when(expires, False),
        allow_nulls=allow_nulls,
        max_bad_rows=max_bad_rows,
        max_failures=_max_failures(spark),
        dry_run=dry_run,
        after_partition=after_partition,
    )
    context = spark.sparkContext
    description = context.getLocalProperty("spark.job.description")
    context.setJobDescription(f"pgqueue: enqueue {task} into {template.queue!r}")
    try:
        results = selected.rdd.mapPartitionsWithIndex(writer).collect()
    finally:
        context.setJobDescription(description)  # type: ignore[arg-type]
    return _summary(results, max_bad_rows, monotonic() - started)


def _summary(results: list[Any], max_bad_rows: int, seconds: float) -> EnqueueSummary:
    parts = [PartitionResult(**found) for found, _, _ in results]
    bad_rows = [BadRow(**bad) for _, _, rows in results for bad in rows][:max_bad_rows]
    failed = tuple(
        PartitionFailure(partition=p.partition, attempts=p.attempt + 1, error=error)
        for p, (_, error, _) in zip(parts, results)
        if error is not None
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
            p.partition: p.attempt
            for p, (_, error, _) in zip(parts, results)
            if p.attempt and error is None
        },
        seconds=seconds,
        copy_seconds=sum(p.copy_seconds for p in parts),
        insert_seconds=sum(p.insert_seconds for p in parts),
    )


# -- the broker read back --------------------------------------------------------------

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
