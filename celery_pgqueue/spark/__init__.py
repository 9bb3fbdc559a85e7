"""Spark pipeline: one Celery task per DataFrame row, and the broker read back as DataFrames.

.. code-block:: python

    from celery_pgqueue.spark import enqueue_dataframe
    summary = enqueue_dataframe(
        df, "app.tasks.scrape", args=["url"], dedup_key="url", dsn="postgresql://app@db/app"
    )
    summary.enqueued, summary.skipped, summary.bad_rows, summary.partitions_failed

Each row becomes the message ``apply_async`` would publish (Celery protocol 2, JSON), so
unmodified workers run it. Each Spark partition writes its rows in one transaction through
psycopg, no JDBC: COPY into a staging table, then an ``INSERT`` that skips a dedup key
another message holds (the broker's ``copy_staging`` and ``publish_staged`` statements), which wakes
consumers with one NOTIFY per queue at commit. Rows reach Python as Arrow batches when
pyarrow and pandas are installed (``pyspark[sql]``; also what Spark Connect needs), else as
pickled rows. From Arrow batches whose columns are strings and integers, for messages
without an ETA or expiry, the messages are built a column at a time (``_columns``); rows
with other text, nulls or bad values go through the per-row builder as before.

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

from ._driver import enqueue_dataframe
from ._results import BadRow, EnqueueSummary, PartitionFailure, PartitionResult
from ._reverse import dead_letters_dataframe, queue_stats_dataframe

__all__ = [
    "BadRow",
    "EnqueueSummary",
    "PartitionFailure",
    "PartitionResult",
    "dead_letters_dataframe",
    "enqueue_dataframe",
    "queue_stats_dataframe",
]
