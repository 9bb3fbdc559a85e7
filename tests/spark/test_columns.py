"""Messages built by columns (Arrow batches) are the per-row builder's, byte for byte."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest
from celery import Celery
from psycopg import sql

from celery_pgqueue.messages import TaskMessageFactory
from celery_pgqueue.spark import enqueue_dataframe
from celery_pgqueue.spark._columns import _Columns
from celery_pgqueue.spark._messages import MAX_KEY_BYTES, _Template
from celery_pgqueue.spark._rows import _builder, _Layout

TASK = "spark_test.record"

TOO_LONG = "k" * (MAX_KEY_BYTES - len(TASK))  # with "spark_test.record:", a byte too long

#: (value, whether the columns take it): plain text, and text that each need the per-row
#: builder for a reason of its own
TEXTS = [
    ("https://example.com/a?b=1&c=[2]#x", True),
    ("", True),
    (" ~!#$%&()*+,-./:;<=>?@[]^_`{|}", True),
    ("it's", False),
    ('say "hi"', False),
    ("back\\slash", False),
    ("tab\there", False),
    ("new\nline", False),
    ("caf\u00e9", False),
    ("\u2603", False),
    ("nul\x00", False),
    ("del\x7f", False),
    (None, False),
    (TOO_LONG, True),  # but not as a key
    ("k" * (MAX_KEY_BYTES - len(TASK) - 1), True),  # as long as a key may be
    ("x" * 3000, True),  # argsrepr is cut at 1024 characters
]
NUMBERS = [0, -1, -(2**31), None, 7, 12, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]


def _layout(kinds: list[str], nargs: int, kwnames: tuple[str, ...], keyed: bool) -> _Layout:
    names = tuple(f"c{i}" for i in range(len(kinds)))
    return _Layout(
        names=names,
        spread=tuple(range(len(kinds))),
        types=tuple(kinds),
        nargs=nargs,
        kwnames=kwnames,
        nkeys=int(keyed),
        priority=None,
        eta=None,
        expires=None,
        convert=(),
        naive_utc=frozenset(),
    )


def _by_rows(template: _Template, layout: _Layout, batch: pa.RecordBatch) -> list[Any]:
    build = _builder(template, layout, allow_nulls=False, eta=None, expires=None)
    rows = zip(*(c.to_pylist() for c in batch.columns)) if batch.num_columns else [()] * len(batch)
    return [build(row) for row in rows]


CASES = {
    "args and a text key": (["string", "long", "string"], 2, (), True),
    "kwargs and an integer key": (["string", "integer", "long"], 1, ("n",), True),
    "only kwargs, no key": (["long", "string"], 0, ("n", "tag"), False),
    "one argument, no key": (["string"], 1, (), False),
    "nothing but the key": (["string"], 0, (), True),
    "no columns at all": ([], 0, (), False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("priority", [None, 5])
def test_columns_build_what_the_row_builder_builds(case: str, priority: int | None) -> None:
    kinds, nargs, kwnames, keyed = CASES[case]
    template = _Template(
        Celery(set_as_current=False), TASK, queue="q", priority=priority, keyed=keyed
    )
    layout = _layout(kinds, nargs, kwnames, keyed)
    plan = _Columns.plan(template, layout)
    assert plan is not None
    arrays = []
    for kind in kinds:
        if kind == "string":
            arrays.append(pa.array([text for text, _ in TEXTS], pa.string()))
        else:
            arrays.append(pa.array(NUMBERS, {"integer": pa.int32()}.get(kind, pa.int64())))
    whole = pa.RecordBatch.from_pydict({"x": NUMBERS})
    batch = (
        pa.RecordBatch.from_arrays(arrays, [f"_{i}" for i in range(len(arrays))])
        if kinds
        else whole
    )
    batch = batch if kinds else whole.select([])  # rows without columns
    built, others = plan.build(batch)

    def by_columns(i: int) -> bool:
        if keyed and kinds[-1] == "string" and len(TEXTS[i][0] or "") >= len(TOO_LONG):
            return False  # a dedup key over MAX_KEY_BYTES
        plain = {"string": TEXTS[i][1], "integer": NUMBERS[i] is not None}
        return all(plain.get(kind, plain["integer"]) for kind in kinds)

    # the rows that can be are built by columns, exactly as the row builder builds them
    assert others == [i for i in range(len(NUMBERS)) if not by_columns(i)]
    want = _by_rows(template, layout, batch)
    assert built == [row for i, row in enumerate(want) if by_columns(i)]
    if "string" in kinds:
        assert len(built) >= 4  # plain text and the longest key at least


def test_columns_plan_only_what_it_can_build() -> None:
    app = Celery(set_as_current=False)
    template = _Template(app, TASK, queue="q", priority=None, keyed=True)
    assert _Columns.plan(template, _layout(["string", "string"], 1, (), True)) is not None
    for kinds in (["double", "string"], ["boolean", "string"], ["struct", "string"]):
        assert _Columns.plan(template, _layout(kinds, 1, (), True)) is None
    assert _Columns.plan(template, _layout(["string", "long", "long"], 2, (), True)) is not None
    two_keys = replace(_layout(["string", "string", "string"], 1, (), True), nkeys=2)
    assert _Columns.plan(template, two_keys) is None
    assert _Columns.plan(template, _layout(["string", "long"], 1, ("my-arg",), False)) is None
    odd = _Template(app, "t\u00e2che", queue="q", priority=None, keyed=True)
    assert _Columns.plan(odd, _layout(["string", "string"], 1, (), True)) is None


def test_enqueue_by_columns_writes_factory_messages_and_leaves_bad_rows(
    spark, dsn, schema, db
) -> None:
    """Plain rows, rows the row builder takes, and bad rows, in one Arrow partition."""
    texts = ["u-0", "it's", "u-2", None, "caf\u00e9", "u-5", "nul\x00", "u-7"]
    rows = [(t, i, f"k-{i}" if t is not None else f"k-{i}") for i, t in enumerate(texts)]
    df = spark.createDataFrame(rows, "url string, n long, key string").coalesce(1)
    app = Celery(set_as_current=False)
    for run in range(2):  # the re-run finds every key taken
        summary = enqueue_dataframe(
            df,
            TASK,
            args=["url"],
            kwargs=["n"],
            dedup_key="key",
            dsn=dsn,
            schema=schema,
            app=app,
            transfer="arrow",
        )
        assert (summary.rows, summary.bad) == (8, 1)
        assert (summary.enqueued, summary.skipped) == ((7, 0) if run == 0 else (0, 7))
        assert [(b.index, b.reason) for b in summary.bad_rows] == [(3, "null in column 'url'")]
    query = sql.SQL("SELECT dedup_key, body, headers::text, properties::text FROM {}.message_store")
    stored = db.execute(query.format(sql.Identifier(schema))).fetchall()
    assert len(stored) == 7
    factory = TaskMessageFactory(app, TASK)
    for dedup_key, body, headers, properties in stored:
        (url,), kwargs, _ = json.loads(bytes(body))
        want = factory.outgoing(
            [url], kwargs, task_id=json.loads(headers)["id"], dedup_key=dedup_key
        )
        assert (bytes(body), headers, properties) == (want.body, want.headers, want.properties)
        assert dedup_key == f"{TASK}:k-{kwargs['n']}" and texts[kwargs["n"]] == url
