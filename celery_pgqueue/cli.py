"""``celery pgqueue ...``: broker commands added to Celery's CLI (entry point ``celery.commands``).

::

    celery -A proj pgqueue migrate
    celery -A proj pgqueue version [--check]
    celery -A proj pgqueue queues [--json]
    celery -A proj pgqueue dead list [--queue Q] [--reason R] [--limit N] [--json]
    celery -A proj pgqueue dead show ID
    celery -A proj pgqueue dead requeue ID... | --all [--queue Q] [--reason R]
    celery -A proj pgqueue dead purge [--queue Q] [--reason R] [--older-than 7d] --yes
    celery -A proj pgqueue purge QUEUE... --yes
    celery -A proj pgqueue delete QUEUE... --yes
    celery -A proj pgqueue metrics [--port 9808] [--schema S] [--interval 10] [--cap 10000]
    celery -A proj pgqueue schedule list|add|pause|resume|remove ...   (_cli_schedule)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import click
import psycopg

from kombu_pgqueue import admin, migrations
from kombu_pgqueue.exceptions import PgQueueError

from ._cli_common import broker_of, table
from ._cli_dead import dead, parse_duration
from ._cli_schedule import schedule
from ._worker import transport_hint


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


class _Commands(click.Group):
    """The commands, each ending in one line when the broker's database cannot be reached,
    pgqueue says what is wrong (a schema not installed, a privilege missing) or Kombu has
    no transport for the broker URL, instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PgQueueError as exc:  # says what is wrong and what to do, in one line
            raise click.ClickException(str(exc)) from exc
        except KeyError as exc:  # Kombu's "No such transport": say what to write instead
            hint = transport_hint(ctx.obj.app) if ctx.obj else None
            if hint is None:
                raise
            raise click.ClickException(hint) from exc
        except psycopg.OperationalError as exc:
            # only a connection that failed; a statement's error (a timeout, a deadlock,
            # a read-only server) keeps its own words and traceback
            if exc.sqlstate is not None and not exc.sqlstate.startswith("08"):
                raise
            where = ctx.obj.app.connection_for_write().as_uri() if ctx.obj else "the broker"
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            reason = " ".join(lines).removeprefix("connection failed: ") or repr(exc)
            raise click.ClickException(
                f"cannot reach the broker's database ({where}): {reason}"
            ) from exc


@click.group(name="pgqueue", cls=_Commands)
def pgqueue() -> None:
    """pgqueue broker: schema, queue sizes and dead letters."""


def where(conninfo: str) -> str:
    """Which database ``conninfo`` reaches, as the server says: ``database 'db' on
    host:port as role`` (libpq fills in what the string leaves out)."""
    with psycopg.connect(conninfo) as conn:
        info = conn.info
        return f"database {info.dbname!r} on {info.host}:{info.port} as {info.user}"


@pgqueue.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Install or upgrade the broker schema, and create Celery's result tables (the
    database backend's) if they are missing: what roles that may not create tables need
    (docs/operations.md, Privileges)."""
    broker = broker_of(ctx)
    applied = broker.migrate()
    done = ", ".join(map(str, applied)) or "nothing (already current)"
    click.echo(f"schema {broker.schema!r} in {where(broker.conninfo)}: applied {done}")
    found = _result_tables(ctx.obj.app)
    if found:
        click.echo(f"Celery's result tables: {found}")


def _result_tables(app: Any) -> str | None:
    """Create the app's result tables as this role if it keeps results in a database
    (Celery creates them as its backend is made, or at its first session); where they
    are, or None for another backend."""
    from celery.backends.database import DatabaseBackend

    backend = app.backend
    if not isinstance(backend, DatabaseBackend):
        return None
    backend.ResultSession().close()
    schemas = app.conf.database_table_schemas or {}
    names = app.conf.database_table_names or {}
    return ", ".join(
        f"{schemas.get(kind) or 'public'}.{names.get(kind) or default}"
        for kind, default in (("task", "celery_taskmeta"), ("group", "celery_tasksetmeta"))
    )


@pgqueue.command()
@click.option("--check", is_flag=True, help="exit 1 unless the schema is the code's version")
@click.pass_context
def version(ctx: click.Context, check: bool) -> None:
    """The broker schema's version against this code's, and what to do."""
    broker = broker_of(ctx, auto_migrate=False)
    have = broker.schema_version()
    said = migrations.describe(have, "celery -A <app> pgqueue migrate")
    click.echo(f"schema {broker.schema!r} in {where(broker.conninfo)}: {said}")
    if check and have != migrations.latest_version():
        raise click.exceptions.Exit(1)


@pgqueue.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def queues(ctx: click.Context, as_json: bool) -> None:
    """Per queue: ready, delayed (ETA), leased (in flight), dead, oldest ready age."""
    broker = broker_of(ctx)
    stats = broker.queue_stats()
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "queue": s.queue,
                        "ready": s.ready,
                        "delayed": s.delayed,
                        "leased": s.leased,
                        "dead": s.dead,
                        "oldest_ready_age_seconds": s.oldest_ready_age,
                    }
                    for s in stats
                ],
                indent=2,
            )
        )
        return
    rows = [
        (s.queue, s.ready, s.delayed, s.leased, s.dead, _age(s.oldest_ready_age)) for s in stats
    ]
    click.echo(table(("queue", "ready", "delayed", "leased", "dead", "oldest ready"), rows))
    waits = storage_waits(broker.monitor().generations())
    if waits:
        click.echo(waits)


def storage_waits(generations: list[admin.Generation]) -> str | None:
    """One line on space that the storage's rotation cannot give back yet, and whose lock
    keeps it; None when nothing waits."""
    waiting = [g for g in generations if g.waiting]
    if not waiting:
        return None
    holders = sorted({(g.blocked_by, g.blocked_by_application or "") for g in waiting})
    who = ", ".join(f"pid {pid}" + (f" ({app})" if app else "") for pid, app in holders)
    longest = max(g.blocked_seconds or 0.0 for g in waiting)
    size = sum(g.total_bytes for g in waiting)
    return (
        f"storage: {size / 1e6:,.1f} MB in {len(waiting)} generation(s) that hold no message "
        f"waits for {who}, whose lock has kept it for {_age(longest)}; it comes back when "
        "that session ends (docs/operations.md, 'Vacuum and bloat')"
    )


@pgqueue.command()
@click.argument("queue_names", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_context
def purge(ctx: click.Context, queue_names: tuple[str, ...], yes: bool) -> None:
    """Delete the waiting messages of QUEUE... (leased ones stay with their consumer)."""
    if not yes:
        click.confirm(f"Delete every waiting message in {', '.join(queue_names)}?", abort=True)
    _each_queue(ctx, queue_names, lambda broker, name: f"purged {broker.purge(name)} messages")


#: what ``delete`` says of a queue that a consumer uses
IN_USE = (
    "not deleted: a consumer uses it (holds one of its messages, or waits for it); stop its "
    "workers first, or --force"
)


@pgqueue.command()
@click.argument("queue_names", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="do not ask")
@click.option("--force", is_flag=True, help="delete a queue that a consumer uses too")
@click.pass_context
def delete(ctx: click.Context, queue_names: tuple[str, ...], yes: bool, force: bool) -> None:
    """Delete QUEUE...: the declaration, bindings and every message (dead letters stay).

    A queue that a consumer uses (holds one of its messages, or waits for it) is left
    alone unless --force; a consumer with transport option listen off, or taking
    messages without acks, is seen only while it holds one. Stop the queue's publishers
    and workers first: a publisher that declared it before sends to it through an
    exchange that no longer routes there, and those messages are dropped as unroutable
    until it restarts."""
    if not yes:
        click.confirm(
            f"Delete {', '.join(queue_names)} with every message"
            f"{', in flight too' if force else ''}? Publishers still running drop what "
            "they send to it",
            abort=True,
        )

    def act(broker: admin.Broker, name: str) -> str | None:
        deleted = broker.delete_queue(name, if_unused=not force)
        return None if deleted is None else f"deleted with {deleted} messages"

    _each_queue(ctx, queue_names, act, refused=IN_USE)


def _each_queue(
    ctx: click.Context,
    queue_names: Sequence[str],
    act: Callable[[admin.Broker, str], str | None],
    refused: str = "",
) -> None:
    """``act`` on each queue that exists, a line for each (``refused`` where ``act``
    returns None); exit 1 if a queue does not exist or was refused."""
    broker = broker_of(ctx)
    failed = False
    for name in queue_names:
        if not broker.queue_exists(name):
            click.echo(f"{name}: no such queue in schema {broker.schema!r}", err=True)
            failed = True
            continue
        said = act(broker, name)
        failed = failed or said is None
        click.echo(f"{name}: {refused if said is None else said}")
    if failed:
        raise click.exceptions.Exit(1)


@pgqueue.command()
@click.option("--port", default=9808, show_default=True, help="0 picks a free port")
@click.option("--addr", default="0.0.0.0", show_default=True)
@click.option("--schema", default=None, help="broker schema  [default: the app's]")
@click.option(
    "--interval",
    default=10.0,
    show_default=True,
    help="seconds between two query sets; scrapes in between share the last one",
)
@click.option(
    "--cap",
    default=admin.DEFAULT_CAP,
    show_default=True,
    help="exact counts up to, estimates above",
)
@click.pass_context
def metrics(
    ctx: click.Context, port: int, addr: str, schema: str | None, interval: float, cap: int
) -> None:
    """Serve Prometheus metrics of the queues (depths, oldest ready age) until stopped."""
    try:
        from celery_pgqueue.metrics import serve_forever
    except ImportError as exc:
        raise click.UsageError(
            f"{exc}; install the metrics extra: pip install 'kombu-pgqueue[metrics]'"
        ) from exc
    # a monitor never installs or upgrades a schema: pgqueue_up says 0 until it exists
    overrides: dict[str, Any] = {"auto_migrate": False, "pool_max_size": 2}
    if schema:
        overrides["schema"] = schema
    try:
        serve_forever(broker_of(ctx, **overrides).monitor(cap=cap), port, addr, interval)
    except OSError as exc:  # the port is taken, or the address is not this machine's
        raise click.ClickException(
            f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}; pick another "
            "--port (0 picks a free one) or --addr"
        ) from exc


pgqueue.add_command(dead)
pgqueue.add_command(schedule)

__all__ = ["dead", "parse_duration", "pgqueue", "table"]
