"""The Spark pipeline against a real PostgreSQL, with Spark in local mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from psycopg import sql
from waiting import wait_for

from celery_pgqueue.messages import TaskMessageFactory
from celery_pgqueue.spark import (
    PartitionFailure,
    dead_letters_dataframe,
    enqueue_dataframe,
    queue_stats_dataframe,
)
from celery_pgqueue.spark import _messages as pipeline
from kombu_pgqueue import migrations
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Store

TASK = "spark_test.record"
DEMO = Path(__file__).resolve().parents[2] / "examples" / "spark_demo.py"


def _messages(db: psycopg.Connection, schema: str) -> list[dict[str, Any]]:
    cur = db.cursor(row_factory=psycopg.rows.dict_row)
    query = sql.SQL(
        "SELECT queue, priority, delayed, next_iteration, expires_at, dedup_key, body,"
        " content_type, content_encoding, headers::text, properties::text"
        " FROM {}.message_store ORDER BY id"
    )
    return cur.execute(query.format(sql.Identifier(schema))).fetchall()


def _urls(spark, count: int, partitions: int = 4):
    from pyspark.sql import functions as F

    return spark.range(0, count, numPartitions=partitions).select(
        F.concat(F.lit("u-"), F.col("id").cast("string")).alias("url"), F.col("id").alias("n")
    )


# -- message format --------------------------------------------------------------------


def test_uuid5_helper_is_uuid5() -> None:
    for name in ("", "a", "spark_test.record:u-1", "\u00e9" * 300):
        assert pipeline._uuid5(name) == str(uuid.uuid5(pipeline.NAMESPACE, name))


@pytest.mark.parametrize("keyed", [True, False])
def test_template_writes_what_the_factory_writes(keyed: bool) -> None:
    app = Celery(set_as_current=False)
    template = pipeline._Template(app, TASK, queue="q", priority=3, keyed=keyed)
    factory = TaskMessageFactory(app, TASK, queue="q", priority=3)
    eta = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc)
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {}),
        (("x" * 3000,), {"k": "\u2603", "n": None}),
        (({"nested": [1, 2.5, True]}, Decimal("1.50")), {"when": eta}),
        (("tab\there", 'quote"', "back\\slash"), {"b": b"bytes"}),
    ]
    for args, kwargs in cases:
        for when, expires in ((None, None), (eta, datetime(2001, 1, 1, tzinfo=timezone.utc))):
            key = "spark_test.record:1" if keyed else None
            body = template.body(args, kwargs)
            row = template.message(args, kwargs, body, "tid", key, 3, when, expires)
            want = factory.outgoing(
                list(args), kwargs, task_id="tid", eta=when, expires=expires, dedup_key=key
            )
            assert template.outgoing(row) == want


def test_enqueued_rows_are_the_factory_messages(spark, dsn, schema, db, transfer) -> None:
    app = Celery(set_as_current=False)  # its thread_oid is the reply_to of both
    df = _urls(spark, 20, partitions=2)
    summary = enqueue_dataframe(
        df, TASK, args=["url"], kwargs=["n"], dsn=dsn, schema=schema, app=app, transfer=transfer
    )
    assert (summary.rows, summary.enqueued, summary.bad) == (20, 20, 0)
    factory = TaskMessageFactory(app, TASK)
    stored = _messages(db, schema)
    assert len(stored) == 20
    for message in stored:
        headers = json.loads(message["headers"])
        (url,), kwargs, _ = json.loads(bytes(message["body"]))
        want = factory.outgoing([url], kwargs, task_id=headers["id"])
        assert message["queue"] == want.queue == "celery"
        assert bytes(message["body"]) == want.body
        assert message["headers"] == want.headers
        assert message["properties"] == want.properties
        assert message["dedup_key"] == want.dedup_key
        assert (message["content_type"], message["content_encoding"]) == (
            "application/json",
            "utf-8",
        )
        assert kwargs == {"n": int(url[2:])}


@pytest.mark.celery
def test_a_real_worker_runs_each_row_once_with_its_arguments(
    spark, app, dsn, schema, db, transfer
) -> None:
    from pyspark.sql import functions as F

    calls: list[tuple[Any, ...]] = []
    lock = threading.Lock()

    @app.task(name=TASK, ignore_result=True, shared=False)
    def record(url: str, n: int, *, tag: str, meta: dict[str, Any], raw: bytes) -> None:
        with lock:
            calls.append((url, n, tag, meta["i"], meta["label"], raw))

    rows = 600
    df = _urls(spark, rows).select(
        "url",
        "n",
        (F.col("n") % 3).cast("string").alias("tag"),
        F.struct(F.col("n").cast("int").alias("i"), F.lit("x").alias("label")).alias("meta"),
        F.encode(F.col("url"), "utf-8").alias("raw"),
    )
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=True):
        summary = enqueue_dataframe(
            df,
            TASK,
            args=["url", "n"],
            kwargs=["tag", "meta", "raw"],
            dedup_key="url",
            dsn=dsn,
            schema=schema,
            app=app,
            transfer=transfer,
        )
        assert (summary.enqueued, summary.skipped, summary.bad) == (rows, 0, 0)
        count = sql.SQL("SELECT count(*) FROM {}.message_store").format(sql.Identifier(schema))
        wait_for(
            lambda: len(calls) >= rows and db.execute(count).fetchone()[0] == 0,
            60,
            f"the worker to run all {rows} rows' tasks and ack them",
            details=lambda: (len(calls), db.execute(count).fetchone()[0]),
        )
    want = [(f"u-{n}", n, str(n % 3), n, "x", f"u-{n}".encode()) for n in range(rows)]
    assert Counter(calls) == Counter(want)
    assert max(Counter(calls).values()) == 1


# -- idempotence -----------------------------------------------------------------------


def test_rerun_with_a_key_column_enqueues_nothing_new(spark, dsn, schema, db) -> None:
    df = _urls(spark, 2000)
    first = enqueue_dataframe(df, TASK, args=["url"], dedup_key="url", dsn=dsn, schema=schema)
    again = enqueue_dataframe(df, TASK, args=["url"], dedup_key="url", dsn=dsn, schema=schema)
    assert (first.rows, first.enqueued, first.skipped) == (2000, 2000, 0)
    assert (again.rows, again.enqueued, again.skipped) == (2000, 0, 2000)
    assert first.ok and again.ok and first.partitions == 4
    # the same key under another task is other work
    other = enqueue_dataframe(
        df, "spark_test.other", args=["url"], dedup_key="url", dsn=dsn, schema=schema
    )
    assert other.enqueued == 2000
    count = sql.SQL("SELECT count(*) FROM {}.message_store").format(sql.Identifier(schema))
    assert db.execute(count).fetchone()[0] == 4000


def test_rerun_without_a_key_column_dedups_on_the_arguments(spark, dsn, schema) -> None:
    df = _urls(spark, 500).unionByName(_urls(spark, 100))  # 100 rows twice
    first = enqueue_dataframe(df, TASK, args=["url", "n"], dsn=dsn, schema=schema)
    again = enqueue_dataframe(df, TASK, args=["url", "n"], dsn=dsn, schema=schema)
    assert (first.rows, first.enqueued, first.skipped) == (600, 500, 100)
    assert (again.enqueued, again.skipped) == (0, 600)


# -- failures --------------------------------------------------------------------------


def test_a_partition_failing_after_its_commit_is_retried_without_duplicates(
    spark, dsn, schema, db, tmp_path, transfer
) -> None:
    marker = tmp_path / "failed-once"

    def fail_once(result: Any) -> None:
        # runs on the executor after the commit: as if the executor died right then
        if result.partition == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("executor lost after commit")

    df = _urls(spark, 400)
    summary = enqueue_dataframe(
        df,
        TASK,
        args=["url"],
        dedup_key="url",
        dsn=dsn,
        schema=schema,
        after_partition=fail_once,
        transfer=transfer,
    )
    assert marker.exists()
    assert summary.ok
    assert summary.partitions_retried == {1: 1}
    # the first attempt's rows are in; the retry found them waiting
    assert (summary.rows, summary.enqueued, summary.skipped) == (400, 300, 100)
    count = sql.SQL("SELECT count(*), count(DISTINCT dedup_key) FROM {}.message_store")
    assert db.execute(count.format(sql.Identifier(schema))).fetchone() == (400, 400)


def test_a_partition_that_keeps_failing_is_reported_not_fatal(spark, dsn, schema, db) -> None:
    migrations.migrate(db, schema)
    db.execute(
        sql.SQL(
            "ALTER TABLE {}.message_store ADD CONSTRAINT refuse_250 CHECK (dedup_key <> {})"
        ).format(sql.Identifier(schema), sql.Literal(f"{TASK}:u-250"))
    )
    summary = enqueue_dataframe(
        _urls(spark, 400), TASK, args=["url"], dedup_key="url", dsn=dsn, schema=schema
    )
    assert not summary.ok
    assert len(summary.partitions_failed) == 1
    failure = summary.partitions_failed[0]
    assert isinstance(failure, PartitionFailure)
    assert (failure.partition, failure.attempts) == (2, 4)
    assert failure.error.startswith("CheckViolation:") and "refuse_250" in failure.error
    assert summary.enqueued == 300  # partition 2 rolled back whole
    count = sql.SQL("SELECT count(*) FROM {}.message_store").format(sql.Identifier(schema))
    assert db.execute(count).fetchone()[0] == 300


def test_bad_rows_are_reported_with_their_row(spark, dsn, schema, db, transfer) -> None:
    rows = [
        ("u-0", 0, b"ok", {"a": 1}),
        ("u-1", None, b"ok", {"a": 1}),
        (None, 2, b"ok", {"a": 1}),
        ("u-\x003", 3, b"ok", {"a": 1}),
        ("u-4", 4, b"\xff\xfe", {"a": 2}),
        ("u-5", 5, b"ok", {"a": 1}),
    ]
    df = spark.createDataFrame(rows, "url string, n long, raw binary, meta map<string,int>")
    df = df.coalesce(1)
    for dry_run in (True, False):
        summary = enqueue_dataframe(
            df,
            TASK,
            args=["url", "n"],
            kwargs={"payload": "raw", "meta": "meta"},
            dedup_key="url",
            dsn=dsn,
            schema=schema,
            dry_run=dry_run,
            transfer=transfer,
        )
        assert summary.ok
        assert (summary.rows, summary.bad) == (6, 3)
        assert summary.enqueued == (0 if dry_run else 3)
        found = {bad.index: bad for bad in summary.bad_rows}
        assert sorted(found) == [1, 2, 3]
        assert found[1].reason == "null in column 'n'"
        assert found[1].key == "u-1" and "'n': None" in found[1].row
        assert found[2].reason == "null in column 'url'"
        assert found[3].reason.startswith("dedup key has a NUL")
        assert "'url': 'u-\\x003'" in found[3].row
        assert {bad.partition for bad in summary.bad_rows} == {0}
    bodies = [json.loads(bytes(m["body"])) for m in _messages(db, schema)]
    assert [b[0] for b in bodies] == [["u-0", 0], ["u-4", 4], ["u-5", 5]]
    assert bodies[0][1] == {"payload": {"__type__": "bytes", "__value__": "ok"}, "meta": {"a": 1}}
    # bytes that are not UTF-8 travel as Kombu's base64
    assert bodies[1][1] == {
        "payload": {"__type__": "base64", "__value__": "//4="},
        "meta": {"a": 2},
    }


def test_bad_rows_in_an_unserialisable_column_and_a_null_key(spark, dsn, schema, transfer) -> None:
    rows = [("u-0", "k0", timedelta(seconds=1)), ("u-1", None, None), ("u-2", "k2", None)]
    df = spark.createDataFrame(rows, "url string, key string, wait interval day to second")
    summary = enqueue_dataframe(
        df.coalesce(1),
        TASK,
        args=["url"],
        kwargs=["wait"],
        dedup_key="key",
        allow_nulls=True,
        dsn=dsn,
        schema=schema,
        transfer=transfer,
    )
    assert (summary.enqueued, summary.bad) == (1, 2)
    reasons = {bad.index: bad.reason for bad in summary.bad_rows}
    assert "timedelta is not JSON serializable" in reasons[0]
    assert reasons[1] == "null in dedup key column 'key'"


# -- priority, ETA, expiry -------------------------------------------------------------


def test_priority_eta_and_expires(spark, dsn, schema, db, transfer) -> None:
    later = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    rows = [("u-0", 9, later), ("u-1", None, None), ("u-2", 300, None)]
    df = spark.createDataFrame(rows, "url string, prio int, at timestamp").coalesce(1)
    summary = enqueue_dataframe(
        df,
        TASK,
        args=["url"],
        dedup_key="url",
        priority="prio",
        eta="at",
        expires=timedelta(days=1),
        dsn=dsn,
        schema=schema,
        transfer=transfer,
    )
    assert (summary.enqueued, summary.bad) == (2, 1)
    assert summary.bad_rows[0].reason == "priority 300 is outside 0-255"
    # the delayed message first: ids need not follow the rows (ready ones go in first)
    first, second = sorted(_messages(db, schema), key=lambda m: not m["delayed"])
    assert (first["priority"], first["delayed"], first["next_iteration"]) == (9, True, later)
    assert json.loads(first["headers"])["eta"] == later.isoformat()
    assert json.loads(first["properties"])["priority"] == 9
    assert (second["priority"], second["delayed"]) == (0, False)
    assert json.loads(second["headers"])["eta"] is None
    for message in (first, second):
        remaining = message["expires_at"] - datetime.now(timezone.utc)
        assert timedelta(hours=23) < remaining <= timedelta(days=1)
        assert 0 < int(json.loads(message["properties"])["expiration"]) <= 86_400_000


def test_missing_columns_are_named(spark, dsn, schema) -> None:
    with pytest.raises(ValueError, match="nope"):
        enqueue_dataframe(_urls(spark, 1), TASK, args=["nope"], dsn=dsn, schema=schema)


# -- the broker read back --------------------------------------------------------------


def test_dead_letters_and_queue_stats_as_dataframes(spark, dsn, schema) -> None:
    df = _urls(spark, 10, partitions=1)
    for task in ("spark_test.fetch", "spark_test.parse"):
        enqueue_dataframe(df, task, args=["url"], dedup_key="url", dsn=dsn, schema=schema)
    store = Store(dsn, parse_options({"schema": schema}))
    lease = 7
    claimed = store.claim("celery", 12, lease)
    for number, message in enumerate(claimed):
        assert store.bury(message.id, lease, "rejected" if number % 3 else "max_attempts")
    dead = dead_letters_dataframe(spark, dsn, schema=schema)
    assert dead.count() == 12
    by_task = {
        (row["task"], row["reason"]): row["count"]
        for row in dead.groupBy("task", "reason").count().collect()
    }
    assert sum(by_task.values()) == 12
    assert by_task[("spark_test.fetch", "max_attempts")] == 4  # claims 0, 3, 6, 9
    assert by_task[("spark_test.fetch", "rejected")] == 6
    assert by_task[("spark_test.parse", "rejected")] == 2
    first = dead.orderBy("id").first()
    assert first["args"] == "('u-0',)" and first["body"].startswith('[["u-0"]')
    stats = {
        row["queue"]: row for row in queue_stats_dataframe(spark, dsn, schema=schema).collect()
    }
    assert (stats["celery"]["ready"], stats["celery"]["dead"]) == (8, 12)


@pytest.mark.celery
@pytest.mark.slow
def test_the_spark_demo_passes_every_check(dsn: str) -> None:
    # the README's example on 2,000 rows instead of 100,000; its own Spark and worker
    done = subprocess.run(
        [sys.executable, str(DEMO)],
        env={**os.environ, "PGQUEUE_DSN": dsn, "SPARK_DEMO_ROWS": "2000"},
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert "4/4 checks passed" in done.stdout, done.stdout
    assert "the same DataFrame again: 0 new, 1,996 already waiting" in done.stdout
