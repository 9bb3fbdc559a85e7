"""Hypothesis against the real database: hostile messages never break a consumer.

What tests/transport/test_bad_inputs.py already pins with fixed examples (awkward
names end to end, NUL in names, a 50 MB body, non-JSON headers, clamped priorities)
is not repeated. Here, generated inputs:

* random bytes under a declared content type (JSON that is not JSON, unknown types,
  odd encodings), read by a Kombu consumer and by a real Celery worker;
* Celery-looking messages whose headers have the wrong types;
* headers of every JSON shape, huge property values, priorities and expirations of
  the wrong type or range;
* queue, exchange and topic routing-key names from arbitrary Unicode and SQL fragments.

Each example checks the same things: the consumer gets the message or a clear error
(a ``PgQueueError``/``ValueError`` at publish, a decode error, a dead letter or a
logged error), its loop keeps going (a well-formed message sent after the bad one is
delivered), and nothing is lost (every message ends consumed, dead-lettered or
reported; none is left behind).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_apps import celery_app
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.transport.virtual.exchange import TopicExchange
from psycopg import sql
from waiting import wait_for

from kombu_pgqueue import ConfigurationError, PgQueueError

FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

SQL_FRAGMENTS = [
    "'",
    '"',
    ";",
    "--",
    "/*",
    "*/",
    "%s",
    "%(queue)s",
    "{schema}",
    "$1",
    "\\",
    "');DROP TABLE message;--",
    '" OR 1=1 --',
    "E'\\x00'",
    "$$",
    "::regclass",
    "LISTEN",
    "pg_notify(",
]
#: any Unicode but NUL (a NUL in a name is refused, see test_bad_inputs) and surrogates
NAME_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
    min_size=1,
    max_size=60,
)
NAMES = st.one_of(
    NAME_TEXT,
    st.lists(st.one_of(st.sampled_from(SQL_FRAGMENTS), NAME_TEXT), min_size=1, max_size=5).map(
        "".join
    ),
)
CONTENT_TYPES = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/x-yaml",
            "application/x-msgpack",
            "application/x-python-serialize",
            "application/data",
            "text/plain",
            "",
        ]
    ),
    st.text(max_size=40).filter(lambda s: "\x00" not in s),
)
ENCODINGS = st.one_of(
    st.sampled_from(["utf-8", "binary", "latin-1", "utf-16", "ascii", ""]),
    st.text(max_size=20).filter(lambda s: "\x00" not in s),
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=50),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=20), children, max_size=5)
    ),
    max_leaves=20,
)


def _one(db: psycopg.Connection, query: sql.Composable, *params: Any) -> Any:
    row = db.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _left(db: psycopg.Connection, schema: str, queue: str) -> int:
    return int(
        _one(
            db,
            sql.SQL("SELECT count(*) FROM {} WHERE queue = %s").format(
                sql.Identifier(schema, "message_store")
            ),
            queue,
        )
    )


def _dead(db: psycopg.Connection, schema: str, queue: str) -> list[str]:
    return [
        r[0]
        for r in db.execute(
            sql.SQL("SELECT reason FROM {} WHERE queue = %s").format(
                sql.Identifier(schema, "dead_letter")
            ),
            (queue,),
        )
    ]


def _draining(conn: Connection, done: Callable[[], bool]) -> Callable[[], bool]:
    """A condition for ``wait_for``: ``done()``, after up to 1 s of ``drain_events`` on
    ``conn`` at each look (a consumer delivers only while its connection is drained)."""

    def delivered() -> bool:
        if done():
            return True
        try:
            conn.drain_events(timeout=1)
        except TimeoutError:
            pass
        return done()

    return delivered


# -- Kombu consumers -----------------------------------------------------------------------


@FUZZ
@given(body=st.binary(max_size=4096), content_type=CONTENT_TYPES, encoding=ENCODINGS)
def test_kombu_consumer_survives_any_body_under_any_content_type(
    connection: Connection,
    db: psycopg.Connection,
    schema: str,
    body: bytes,
    content_type: str,
    encoding: str,
) -> None:
    queue = f"fuzz-{uuid.uuid4().hex[:8]}"
    producer = Producer(connection)
    producer.publish(
        body,
        routing_key=queue,
        content_type=content_type,
        content_encoding=encoding,
        declare=[Queue(queue)],
    )
    producer.publish({"sentinel": True}, routing_key=queue)
    decoded: list[Any] = []
    errors: list[Exception] = []

    def on_message(payload: Any, message: Any) -> None:
        decoded.append(payload)
        message.ack()

    def on_decode_error(message: Any, exc: Exception) -> None:
        errors.append(exc)
        message.reject()  # -> dead letter, reason "rejected"

    with Consumer(
        connection,
        [Queue(queue)],
        callbacks=[on_message],
        on_decode_error=on_decode_error,
        accept=["json", "application/data", "text/plain"],
    ):
        wait_for(
            _draining(connection, lambda: len(decoded) + len(errors) >= 2),
            15,
            "the bad message and the sentinel delivered or refused",
        )

    assert {"sentinel": True} in decoded  # the loop kept going past the bad message
    assert len(decoded) + len(errors) == 2
    assert _left(db, schema, queue) == 0  # nothing left behind
    assert _dead(db, schema, queue) == ["rejected"] * len(errors)  # nothing lost


@FUZZ
@given(
    headers=st.dictionaries(st.text(max_size=30), JSON, max_size=6),
    eta=st.one_of(st.none(), JSON, st.text(max_size=40)),
    priority=st.one_of(
        st.none(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(max_size=10),
        st.booleans(),
    ),
    expiration=st.one_of(st.none(), JSON, st.floats(), st.text(max_size=10)),
    huge=st.sampled_from([0, 1_000, 1_000_000]),
)
def test_odd_headers_priorities_and_huge_properties_are_stored_or_refused_clearly(
    connection: Connection,
    db: psycopg.Connection,
    schema: str,
    headers: dict[str, Any],
    eta: Any,
    priority: Any,
    expiration: Any,
    huge: int,
) -> None:
    queue = f"fuzz-{uuid.uuid4().hex[:8]}"
    headers = {**headers, "eta": eta} if eta is not None else headers
    headers.pop("dedup_key", None)  # a key would make the sentinel a duplicate
    properties: dict[str, Any] = {"correlation_id": "c" * huge, "reply_to": "r" * huge}
    producer = Producer(connection)
    Queue(queue)(connection.default_channel).declare()
    refused: Exception | None = None
    try:
        producer.publish(
            "odd",
            routing_key=queue,
            headers=headers,
            priority=priority,
            expiration=expiration,
            **properties,
        )
    except (PgQueueError, ValueError, TypeError, OverflowError) as exc:
        refused = exc
    except psycopg.Error as exc:  # a database error leaking out is the bug we look for
        pytest.fail(f"publish raised a raw database error: {exc!r}")
    producer.publish("sentinel", routing_key=queue)

    if refused is not None:
        assert str(refused)  # says something
        assert _left(db, schema, queue) == 1  # only the sentinel was stored
    stored_priorities = db.execute(
        sql.SQL("SELECT priority FROM {} WHERE queue = %s").format(
            sql.Identifier(schema, "message_store")
        ),
        (queue,),
    ).fetchall()
    assert all(0 <= p <= 255 for (p,) in stored_priorities)  # clamped in the row
    got: list[Any] = []
    with Consumer(connection, [Queue(queue)], callbacks=[lambda b, m: (got.append(m), m.ack())]):
        wait_for(
            _draining(connection, lambda: any(m.body == b"sentinel" for m in got)),
            15,
            "the sentinel delivered",
        )
    stored = [m for m in got if m.body == b"odd"]
    for message in stored:
        assert message.headers == headers
        assert message.properties["correlation_id"] == "c" * huge
    # a message still waiting is one that asked to wait (an eta) or to die (expiration)
    left = _left(db, schema, queue)
    assert left in (0, 1)
    if left:
        assert refused is None and not stored and (eta is not None or expiration is not None)


@FUZZ
@given(queue_name=NAMES, exchange_name=NAMES)
def test_generated_queue_and_exchange_names_round_trip(
    connection: Connection,
    db: psycopg.Connection,
    schema: str,
    queue_name: str,
    exchange_name: str,
) -> None:
    tag = uuid.uuid4().hex[:6]
    queue_name, exchange_name = f"{queue_name}{tag}", f"{exchange_name}{tag}"
    exchange = Exchange(exchange_name, "direct")
    queue = Queue(queue_name, exchange, routing_key=queue_name)
    got: list[Any] = []
    with Consumer(connection, [queue], callbacks=[lambda b, m: (got.append(b), m.ack())]):
        Producer(connection).publish(
            {"via": "exchange"}, exchange=exchange_name, routing_key=queue_name
        )
        Producer(connection).publish({"via": "default"}, routing_key=queue_name)
        wait_for(_draining(connection, lambda: len(got) >= 2), 15, "both messages delivered")

    assert sorted(b["via"] for b in got) == ["default", "exchange"]
    assert _left(db, schema, queue_name) == 0
    store = connection.default_channel.store
    assert store.exchange_type(exchange_name) == "direct"
    assert store.bindings(exchange_name) == [(queue_name, None, queue_name)]


TOPIC_WORDS = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "*",
                "#",
                "a",
                "b",
                "(a)",
                "a|b",
                "[ab]",
                "a+",
                "a?",
                "^",
                "$",
                "\\d",
                "\\",
                "{2}",
                ".*",
                "ü",
            ]
        ),
        st.text(
            alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00."),
            min_size=1,
            max_size=4,
        ),
    ),
    min_size=1,
    max_size=4,
).map(".".join)


@FUZZ
@given(binding=TOPIC_WORDS, keys=st.lists(TOPIC_WORDS, min_size=1, max_size=6, unique=True))
# Python's . stops at a newline and its final $ also matches before one; PostgreSQL's not
@example(binding="#", keys=["\n0", "a\n"])
@example(binding="a.*", keys=["a.\n", "a.b\n", "a.b\nc"])
# a '*' inside a word is a regex quantifier to Kombu: here one with nothing to repeat
@example(binding="*0", keys=["*"])
def test_topic_routing_agrees_with_kombus_matcher_on_generated_keys(
    connection: Connection, db: psycopg.Connection, schema: str, binding: str, keys: list[str]
) -> None:
    tag = uuid.uuid4().hex[:8]
    exchange, queue = f"topic-{tag}", f"tq-{tag}"
    pattern = TopicExchange(connection.default_channel).key_to_pattern(binding)
    try:
        re.compile(pattern)
    except re.error:
        # Kombu could never route through it: refused at bind time, nothing stored, and
        # publishing to the exchange goes on working
        with pytest.raises(ConfigurationError, match="topic binding key"):
            Queue(queue, Exchange(exchange, "topic"), binding)(connection.default_channel).declare()
        assert connection.default_channel.store.bindings(exchange) == []
        Producer(connection).publish("x", exchange=exchange, routing_key="x")
        return
    Queue(queue, Exchange(exchange, "topic"), binding)(connection.default_channel).declare()
    keys = [*keys, binding.replace("*", "x").replace("#", "x")]
    for key in keys:
        Producer(connection).publish(key, exchange=exchange, routing_key=key)

    expected = [key for key in keys if re.match(pattern, key)]
    got = []
    channel = connection.default_channel
    while (message := channel.basic_get(queue)) is not None:
        got.append(message.payload)
        message.ack()
    assert got == expected, (binding, pattern)


# -- a real Celery worker ------------------------------------------------------------------


class _Errors(logging.Handler):
    """Collects the worker's error records (thread-safe: logging locks around emit)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def app(dsn: str, schema: str) -> Iterator[Celery]:
    app = celery_app(
        dsn,
        schema,
        main=f"fuzz_{schema}",
        results=False,
        max_attempts=3,
        conf={"task_acks_late": True, "task_ignore_result": True},
    )
    yield app
    app.close()


@pytest.fixture
def fuzz_worker(app: Celery) -> Iterator[tuple[Celery, list[str], _Errors]]:
    ran: list[str] = []

    @app.task(name="fuzz.ok", shared=False)
    def ok(tag: str) -> None:
        ran.append(tag)

    errors = _Errors()
    celery_logger = logging.getLogger("celery")
    celery_logger.addHandler(errors)
    try:
        with start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            shutdown_timeout=30,
            loglevel="WARNING",
        ) as worker:
            yield app, ran, errors
            assert worker.blueprint.state == 1  # RUN: the worker is still running
    finally:
        celery_logger.removeHandler(errors)


def _not_json(data: bytes) -> bool:
    try:
        json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return True
    return False


#: (content type, body) pairs where the body cannot be what the type says, or the type
#: is one the worker does not accept (pickle, yaml, unknown): decoding must fail
UNDECODABLE = st.one_of(
    # not empty: Celery reads an empty JSON body as bytes and crashes, on any broker
    st.tuples(st.just("application/json"), st.binary(min_size=1, max_size=512).filter(_not_json)),
    st.tuples(
        st.sampled_from(
            ["application/x-python-serialize", "application/x-yaml", "text/plain", "nonsense/type"]
        ),
        st.binary(min_size=1, max_size=512),
    ),
)


@settings(FUZZ, max_examples=15)
@given(
    undecodable=UNDECODABLE, as_task=st.booleans(), encoding=st.sampled_from(["utf-8", "binary"])
)
def test_celery_worker_survives_bodies_invalid_for_their_content_type(
    fuzz_worker: tuple[Celery, list[str], _Errors],
    db: psycopg.Connection,
    schema: str,
    undecodable: tuple[str, bytes],
    as_task: bool,
    encoding: str,
) -> None:
    """Celery logs a decode error and drops the message (it acks it); the loop goes on.

    Headers stay well-formed here: Celery itself (not the transport) crashes on task
    messages whose ``task``/``id`` headers or body have the wrong type, whatever the
    broker; wrong-typed headers are fuzzed at the Kombu level above.
    """
    app, ran, errors = fuzz_worker
    content_type, body = undecodable
    headers = {"task": "fuzz.ok", "id": str(uuid.uuid4())} if as_task else {}
    # a retried example may reuse generated ids: keep this example's messages apart
    marker = uuid.uuid4().hex
    before = len(errors.records)
    ran_before = len(ran)
    dead_before = len(_dead(db, schema, "celery"))
    with app.connection_for_write() as conn:
        Producer(conn).publish(
            body,
            routing_key="celery",
            content_type=content_type,
            content_encoding=encoding,
            headers={**headers, "fuzz-marker": marker},
        )
    app.send_task("fuzz.ok", (marker,))

    wait_for(lambda: marker in ran, 30, "the well-formed task after the bad message")

    def settled() -> bool:
        # the bad message is gone: run, dead-lettered or dropped with a logged error
        left = _one(
            db,
            sql.SQL("SELECT count(*) FROM {} WHERE headers->>'fuzz-marker' = %s").format(
                sql.Identifier(schema, "message_store")
            ),
            marker,
        )
        return left == 0

    wait_for(settled, 30, "the bad message to be dealt with")
    dead = len(_dead(db, schema, "celery")) - dead_before
    reported = len(errors.records) - before
    executed = len(ran) - ran_before - 1
    assert executed == 0  # nothing undecodable ran
    # a dead letter or a logged error accounts for the bad message
    assert dead + reported >= 1, (headers, content_type, body[:80])
    assert (
        any(
            marker in r.getMessage() or "decode" in r.getMessage().lower()
            for r in errors.records[before:]
        )
        or dead
    )
