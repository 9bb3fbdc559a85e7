"""The broker read back as DataFrames: dead letters and queue statistics."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

from ._driver import _broker

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
    found = _broker(dsn, transport_options, schema).dead_letters(queue, limit)
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
    stats = _broker(dsn, transport_options, schema).queue_stats()
    return spark.createDataFrame(
        [asdict(s) for s in stats],
        "queue string, ready long, delayed long, leased long, dead long, oldest_ready_age double",
    )
