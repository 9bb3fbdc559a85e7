"""enqueue_dataframe: the driver side, which plans the job and sums up its partitions."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from time import monotonic
from typing import TYPE_CHECKING, Any, Literal

from psycopg.conninfo import conninfo_to_dict

from kombu_pgqueue import admin

if TYPE_CHECKING:
    from celery import Celery
    from pyspark.sql import DataFrame, SparkSession

from ._columns import _Columns
from ._messages import _Template
from ._results import EnqueueSummary, PartitionResult, _summary
from ._rows import _Layout, _when
from ._writer import _Writer

# -- the driver ---------------------------------------------------------------------------


def _max_failures(spark: SparkSession) -> int:
    """How many attempts Spark gives a task (local masters ignore spark.task.maxFailures)."""
    master = spark.conf.get("spark.master", "") or ""
    if master.startswith("local") and not master.startswith("local-cluster"):
        found = re.fullmatch(r"local\[[^,\]]+,\s*(\d+)\]", master)
        return int(found[1]) if found else 1
    return int(spark.conf.get("spark.task.maxFailures", "4") or 4)


def _broker(
    dsn: str, transport_options: Mapping[str, Any] | None, schema: str | None
) -> admin.Broker:
    options = {**(transport_options or {}), **({"schema": schema} if schema else {})}
    if "application_name" not in conninfo_to_dict(dsn):
        options.setdefault("application_name", "pgqueue-spark")
    return admin.Broker(dsn, **options)


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
    # a column named twice (an argument and the key) crosses to Python once
    unique = list(dict.fromkeys(names))
    quoted = ["`" + n.replace("`", "``") + "`" for n in unique]
    selected = df.select(*[F.col(q).alias(f"_{i}") for i, q in enumerate(quoted)])
    spread = tuple(unique.index(n) for n in names)
    types = [selected.schema.fields[i].dataType.typeName() for i in spread]
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
        spread=spread,
        types=tuple(types),
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
    broker = _broker(dsn, transport_options, schema)
    broker.ensure_schema()  # fails here, not on the executors
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
    # by columns: messages without an ETA or expiry, of one priority (the plan checks
    # the column types)
    by_columns = arrow and eta is None and expires is None and not extras
    columns = _Columns.plan(template, layout) if by_columns else None
    writer = _Writer(
        template=template,
        layout=layout,
        conninfo=broker.conninfo,
        schema=broker.schema,
        eta=None if eta is None or isinstance(eta, str) else _when(eta, False),
        expires=None if expires is None or isinstance(expires, str) else _when(expires, False),
        allow_nulls=allow_nulls,
        max_bad_rows=max_bad_rows,
        max_failures=_max_failures(spark),
        dry_run=dry_run,
        after_partition=after_partition,
        columns=columns,
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
