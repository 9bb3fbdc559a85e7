"""``celery pgqueue ...`` run as a user runs it: ``celery -A app pgqueue ...`` in a
subprocess, found through the ``celery.commands`` entry point. Each command's effect
is checked in the database."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from kombu import Consumer, Queue
from ledger import create_ledger
from lifecycle_app import make_app, pgqueue_cli
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from waiting import wait_for

import kombu_pgqueue
from celery_pgqueue.cli import parse_duration
from kombu_pgqueue import admin, codec, migrations
from kombu_pgqueue._sql import LOCKS

pytestmark = pytest.mark.celery


Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(dsn: str, schema: str) -> Cli:
    def run(*args: str, ok: bool = True, stdin: str = "", **settings: Any) -> Any:
        done = pgqueue_cli("lifecycle_app", dsn, schema, *args, stdin=stdin, **settings)
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    return run


@pytest.fixture
def sent(dsn: str, schema: str, db: psycopg.Connection) -> Iterator[dict[str, list[str]]]:
    """Task ids by queue: 3 ready and 1 delayed in 'celery', 2 in 'other', and 2 that
    a consumer rejected, so they are dead letters of 'doomed'."""
    kombu_pgqueue.migrate(dsn, schema)
    create_ledger(db, schema)
    app = make_app(dsn, schema)
    try:
        ids = {
            "celery": [app.send_task("lifecycle.work", (f"c{i}",)).id for i in range(3)],
            "delayed": [app.send_task("lifecycle.work", ("later",), countdown=3600).id],
            "other": [
                app.send_task("lifecycle.work", (f"o{i}",), queue="other").id for i in range(2)
            ],
            "doomed": [
                app.send_task("lifecycle.work", (f"d{i}", i), queue="doomed").id for i in range(2)
            ],
        }
        with app.connection_for_write() as conn:
            for _ in ids["doomed"]:
                conn.default_channel.basic_get("doomed").reject()
        yield ids
    finally:
        app.close()


def rows(db: psycopg.Connection, schema: str, table: str) -> list[dict[str, Any]]:
    lease = sql.SQL("lease" if table == "message_store" else "NULL::bigint")
    with db.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL(
                "SELECT id, queue, headers->>'id' AS task_id, attempts, {} AS lease FROM {} "
                "ORDER BY id"
            ).format(lease, sql.Identifier(schema, table))
        ).fetchall()


def task_ids(found: list[dict[str, Any]], queue: str | None = None) -> list[str]:
    return [r["task_id"] for r in found if queue is None or r["queue"] == queue]


def test_a_schema_not_installed_is_one_line_not_a_traceback(cli, db, schema):
    done = cli("queues", ok=False, auto_migrate="false")

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("Error: "), line
    assert "migrate" in line  # SchemaError names the command to run


def test_version_before_and_after_migrate(cli, db, schema):
    latest = kombu_pgqueue.migrations.latest_version()
    said = f": not installed, code needs {latest}: run celery -A <app> pgqueue migrate"
    assert cli("version").stdout.strip().endswith(said)
    before = cli("version", "--check", ok=False)
    assert before.returncode == 1
    assert before.stdout.strip().endswith(said)
    assert not db.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()

    cli("migrate")
    assert cli("version", "--check").stdout.strip().endswith(f": version {latest}, current")


def test_migrate_installs_then_reports_current(cli, db, schema):
    latest = migrations.latest_version()
    done = cli("migrate", auto_migrate="false")
    applied = ", ".join(str(v) for v in range(1, latest + 1))
    info = db.info
    target = f"database {info.dbname!r} on {info.host}:{info.port} as {info.user}"
    assert done.stdout.strip() == f"schema {schema!r} in {target}: applied {applied}"
    assert kombu_pgqueue.current_version(db, schema) == latest
    assert rows(db, schema, "message_store") == []

    again = cli("migrate", auto_migrate="false")
    assert (
        again.stdout.strip() == f"schema {schema!r} in {target}: applied nothing (already current)"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ({"dbname": "no_such_database_here"}, 'database "no_such_database_here" does not exist'),
        # libpq's reason is on the first of its lines, its hint on the second
        ({"host": "127.0.0.1", "port": "free"}, "Connection refused"),
    ],
    ids=["no-such-database", "nothing-listening"],
)
def test_a_database_that_cannot_be_reached_is_one_line_not_a_traceback(dsn, schema, where, reason):
    if where.get("port") == "free":
        where = {**where, "port": str(_free_port())}
    missing = make_conninfo(dsn, **where)
    done = pgqueue_cli("lifecycle_app", missing, schema, "queues")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("Error: cannot reach the broker's database (pgqueue://"), line
    assert reason in line


def test_queues_counts_ready_delayed_and_dead_per_queue(cli, sent):
    stats = json.loads(cli("queues", "--json").stdout)
    by_queue = {s["queue"]: s for s in stats}
    assert set(by_queue) == {"celery", "other", "doomed"}
    counts = {q: (s["ready"], s["delayed"], s["leased"], s["dead"]) for q, s in by_queue.items()}
    assert counts == {"celery": (3, 1, 0, 0), "other": (2, 0, 0, 0), "doomed": (0, 0, 0, 2)}
    assert by_queue["celery"]["oldest_ready_age_seconds"] >= 0
    assert by_queue["doomed"]["oldest_ready_age_seconds"] is None

    lines = cli("queues").stdout.splitlines()
    assert lines[0].split() == ["queue", "ready", "delayed", "leased", "dead", "oldest", "ready"]
    assert set(lines[1]) == {"-", " "}
    table = {line.split()[0]: line.split()[1:5] for line in lines[2:]}
    assert table == {
        "celery": ["3", "1", "0", "0"],
        "doomed": ["0", "0", "0", "2"],
        "other": ["2", "0", "0", "0"],
    }


def test_dead_list_and_show(cli, sent, db, schema):
    found = json.loads(cli("dead", "list", "--json").stdout)
    assert [d["task_id"] for d in found] == sent["doomed"]
    assert {(d["queue"], d["task"], d["reason"], d["attempts"]) for d in found} == {
        ("doomed", "lifecycle.work", "rejected", 1)
    }
    assert [d["id"] for d in found] == [r["id"] for r in rows(db, schema, "dead_letter")]
    assert json.loads(cli("dead", "list", "--queue", "other", "--json").stdout) == []

    listed = cli("dead", "list").stdout
    assert listed.splitlines()[0].split() == [
        "id",
        "queue",
        "task",
        "task_id",
        "reason",
        "attempts",
        "died_at",
        "error",
    ]
    assert all(task_id in listed for task_id in sent["doomed"])

    shown = json.loads(cli("dead", "show", str(found[1]["id"]), "--json").stdout)
    assert shown["id"] == found[1]["id"]
    assert shown["headers"]["id"] == sent["doomed"][1]
    assert shown["headers"]["task"] == "lifecycle.work"
    assert json.loads(shown["body"])[0] == ["d1", 1]
    assert shown["error"] is None  # rejected: no exception to show
    assert shown["traceback"] is None

    missing = cli("dead", "show", "987654321", ok=False)
    assert missing.returncode != 0
    assert "no dead letter with id 987654321" in missing.stderr


def test_dead_requeue_one_then_all(cli, sent, db, schema):
    first, second = (r["id"] for r in rows(db, schema, "dead_letter"))

    missing = max(first, second) + 1000
    done = cli("dead", "requeue", str(first), str(missing), ok=False)
    assert done.returncode == 1  # a mistyped id is not a success
    assert done.stdout.strip() == "requeued 1 dead letters into doomed"
    assert done.stderr.strip() == f"no dead letter with id {missing}"
    assert [r["id"] for r in rows(db, schema, "dead_letter")] == [second]
    back = [r for r in rows(db, schema, "message_store") if r["queue"] == "doomed"]
    assert [(r["task_id"], r["attempts"], r["lease"]) for r in back] == [
        (sent["doomed"][0], 0, None)
    ]

    done = cli("dead", "requeue", "--all")
    assert done.stdout.strip() == "requeued 1 dead letters into doomed"
    assert rows(db, schema, "dead_letter") == []
    assert task_ids(rows(db, schema, "message_store"), "doomed") == sent["doomed"]

    refused = cli("dead", "requeue", ok=False)
    assert refused.returncode != 0
    assert "name dead letter ids, or pass --all" in refused.stderr


def test_a_reason_that_is_not_one_is_refused(cli, sent, db, schema):
    done = cli("dead", "purge", "--reason", "Failed", "--yes", ok=False)

    assert done.returncode == 2  # a typo is not "deleted 0 dead letters"
    assert "Invalid value for '--reason'" in done.stderr
    assert "'failed'" in done.stderr  # the reasons there are
    assert len(rows(db, schema, "dead_letter")) == 2


def test_metrics_on_a_port_taken_is_one_line(cli, sent):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("metrics", "--port", str(port), "--addr", "127.0.0.1", ok=False)

    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot serve metrics on 127.0.0.1:{port}: "), line
    assert "--port" in line


def test_dead_purge(cli, sent, db, schema):
    # without --yes it asks, and a "no" keeps everything
    asked = cli("dead", "purge", ok=False, stdin="n\n")
    assert asked.returncode != 0
    assert len(rows(db, schema, "dead_letter")) == 2

    assert cli("dead", "purge", "--queue", "other", "--yes").stdout.strip() == (
        "deleted 0 dead letters"
    )
    assert len(rows(db, schema, "dead_letter")) == 2
    assert cli("dead", "purge", "--yes").stdout.strip() == "deleted 2 dead letters"
    assert rows(db, schema, "dead_letter") == []
    assert len(rows(db, schema, "message_store")) == 6  # the live queues are untouched


def test_purge_queues(cli, sent, db, schema):
    done = cli("purge", "other", "--yes")
    assert done.stdout.strip() == "other: purged 2 messages"
    left = rows(db, schema, "message_store")
    assert task_ids(left, "other") == []
    assert task_ids(left) == sent["celery"] + sent["delayed"]

    done = cli("purge", "celery", "nothing-here", "--yes", ok=False)
    assert done.returncode == 1  # a typo is not a success
    assert done.stdout.splitlines() == ["celery: purged 4 messages"]
    assert done.stderr.strip() == f"nothing-here: no such queue in schema {schema!r}"
    assert rows(db, schema, "message_store") == []
    assert len(rows(db, schema, "dead_letter")) == 2  # purge leaves dead letters alone


def test_delete_queues(cli, sent, db, schema):
    held = sql.SQL(
        "UPDATE {table} SET lease = 1, next_iteration = now() + interval '1 hour' "
        "WHERE id = (SELECT min(id) FROM {table} WHERE queue = 'other')"
    ).format(table=sql.Identifier(schema, "message_store"))
    db.execute(held)  # one in flight: a consumer uses the queue
    bindings = sql.SQL("SELECT count(*) FROM {} WHERE queue = 'other'").format(
        sql.Identifier(schema, "binding")
    )
    assert db.execute(bindings).fetchone() == (1,)

    refused = cli("delete", "other", "--yes", ok=False)

    assert refused.returncode == 1
    assert refused.stdout.splitlines() == [
        "other: not deleted: a consumer uses it (holds one of its messages, or waits for "
        "it); stop its workers first, or --force"
    ]
    assert len(task_ids(rows(db, schema, "message_store"), "other")) == 2
    assert db.execute(bindings).fetchone() == (1,)

    done = cli("delete", "other", "nothing-here", "--yes", "--force", ok=False)

    assert done.returncode == 1
    assert done.stdout.splitlines() == ["other: deleted with 2 messages"]
    assert done.stderr.strip() == f"nothing-here: no such queue in schema {schema!r}"
    left = rows(db, schema, "message_store")
    assert task_ids(left, "other") == []  # the one in flight too, as RabbitMQ's queue.delete
    assert task_ids(left) == sent["celery"] + sent["delayed"]
    assert db.execute(bindings).fetchone() == (0,)
    names = sql.SQL("SELECT name FROM {} ORDER BY name").format(sql.Identifier(schema, "queue"))
    assert "other" not in [name for (name,) in db.execute(names)]
    assert "other" not in [q["queue"] for q in json.loads(cli("queues", "--json").stdout)]
    assert len(rows(db, schema, "dead_letter")) == 2  # dead letters stay


def test_delete_leaves_a_queue_an_idle_consumer_waits_for(cli, sent, db, schema, dsn):
    cli("purge", "other", "--yes")
    # the queue's watch lock (see the top of sql/queries.sql), held while a consumer waits
    key = f"{admin.Broker(dsn, schema=schema).options.channel}:other"
    watches = sql.SQL(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = {lock} "
        "AND objid = (hashtext({key})::bigint & 4294967295)::oid"
    ).format(key=sql.Literal(key), lock=sql.Literal(LOCKS["lock_waiting"]))
    assert db.execute(watches).fetchone() == (0,)
    app = make_app(dsn, schema)
    try:
        with app.connection_for_write() as conn, Consumer(conn, queues=[Queue("other")]):
            with pytest.raises(TimeoutError):  # nothing to take: it waits for the queue
                conn.drain_events(timeout=0.05)
            wait_for(lambda: db.execute(watches).fetchone() == (1,), 10, "the consumer's watch")

            refused = cli("delete", "other", "--yes", ok=False)

        assert refused.returncode == 1
        assert refused.stdout.startswith("other: not deleted: a consumer uses it")
        assert cli("delete", "other", "--yes").stdout.strip() == "other: deleted with 0 messages"
    finally:
        app.close()


@pytest.fixture
def failed(dsn: str, schema: str, sent: dict[str, list[str]]) -> int:
    """The first message of 'other' kept as a task that failed for good: its letter id."""
    app = make_app(dsn, schema)
    try:
        with app.connection_for_write() as conn:
            message = conn.default_channel.basic_get("other")
            message_id, lease = codec.parse_tag(message.delivery_tag)
            kept = admin.Broker.from_connection(conn).bury_failed(
                admin.Failure(
                    id=message_id,
                    lease=lease,
                    attempts=1,
                    # the stored row is held, so it is kept instead of this
                    message=admin.Outgoing(queue="other", body=b"", headers="{}", properties="{}"),
                    error="tasks.PaymentDeclined: " + "card declined " * 10,
                    traceback="Traceback (most recent call last):\n  ...\n",
                    move=True,
                )
            )
    finally:
        app.close()
    assert kept == message_id
    return message_id


def age(db: psycopg.Connection, schema: str, ids: list[int], days: float) -> None:
    """Make dead letters ``ids`` die ``days`` earlier: time moves in the data, not by sleeping."""
    db.execute(
        sql.SQL(
            "UPDATE {} SET died_at = died_at - make_interval(days => %s) WHERE id = ANY(%s)"
        ).format(sql.Identifier(schema, "dead_letter")),
        (days, ids),
    )


def test_dead_list_by_reason_shows_a_failed_tasks_error(cli, sent, failed):
    found = json.loads(cli("dead", "list", "--reason", "failed", "--json").stdout)
    assert [(d["id"], d["queue"], d["task"], d["retries"]) for d in found] == [
        (failed, "other", "lifecycle.work", 0)
    ]
    assert found[0]["task_id"] == sent["other"][0]
    assert found[0]["argsrepr"] == "('o0',)"
    assert found[0]["error"].startswith("tasks.PaymentDeclined: card declined")
    rejected = json.loads(cli("dead", "list", "--reason", "rejected", "--json").stdout)
    assert [d["task_id"] for d in rejected] == sent["doomed"]

    lines = cli("dead", "list", "--reason", "failed").stdout.splitlines()
    assert len(lines) == 3 and lines[0].split()[-1] == "error"
    # the table shows the error's last line, cut short; dead show has it whole
    assert lines[2].endswith("tasks.PaymentDeclined: card declined card declined card d...")
    shown = json.loads(cli("dead", "show", str(failed), "--json").stdout)
    assert shown["error"] == "tasks.PaymentDeclined: " + "card declined " * 10
    assert shown["traceback"] == "Traceback (most recent call last):\n  ...\n"
    # without --json the traceback follows as Python prints it, not as an escaped string
    text = cli("dead", "show", str(failed)).stdout
    assert text.endswith("}\n\nTraceback (most recent call last):\n  ...\n")
    assert '"traceback"' not in text


def test_dead_requeue_all_of_a_reason(cli, sent, failed, db, schema):
    done = cli("dead", "requeue", "--all", "--reason", "failed")
    assert done.stdout.strip() == "requeued 1 dead letters into other"
    assert task_ids(rows(db, schema, "dead_letter")) == sent["doomed"]
    # the task's message again, with its task id: a worker runs it as that task
    assert (
        task_ids(rows(db, schema, "message_store"), "other")
        == sent["other"][1:] + sent["other"][:1]
    )


def test_dead_purge_older_than_and_by_reason(cli, sent, failed, db, schema):
    doomed = [r["id"] for r in rows(db, schema, "dead_letter") if r["queue"] == "doomed"]
    age(db, schema, [doomed[0], failed], days=8)
    age(db, schema, [doomed[1]], days=6)

    done = cli("dead", "purge", "--reason", "failed", "--older-than", "7d", "--yes")
    assert done.stdout.strip() == "deleted 1 dead letters"
    assert [r["id"] for r in rows(db, schema, "dead_letter")] == doomed

    assert cli("dead", "purge", "--older-than", "1w", "--yes").stdout.strip() == (
        "deleted 1 dead letters"
    )
    assert cli("dead", "purge", "--older-than", "5d23h", "--yes").stdout.strip() == (
        "deleted 1 dead letters"
    )
    assert rows(db, schema, "dead_letter") == []


def test_dead_purge_asks_naming_what_it_deletes_and_refuses_a_bad_duration(cli, sent, db, schema):
    asked = cli("dead", "purge", "--reason", "failed", "--older-than", "7d", ok=False, stdin="n\n")
    assert asked.returncode != 0
    assert (
        "Delete the dead letters of every queue with reason failed that died over "
        "7 days, 0:00:00 ago for good?"
    ) in asked.stdout

    bad = cli("dead", "purge", "--older-than", "7 days", "--yes", ok=False)
    assert bad.returncode == 2
    assert "'7 days' is not a duration" in bad.stderr
    assert len(rows(db, schema, "dead_letter")) == 2


@pytest.mark.parametrize(
    "text, seconds",
    [("30s", 30), ("90m", 5400), ("12h", 43200), ("7d", 604800), ("2w", 1209600),
     ("1d12h", 129600), ("1.5h", 5400), (" 7D ", 604800)],
)  # fmt: skip
def test_parse_duration(text: str, seconds: int) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7 d", "7days", "-7d", "7d ago", "1d12"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)
