"""``celery pgqueue ...``: broker commands added to Celery's CLI (entry point ``celery.commands``).

::

    celery -A proj pgqueue migrate
    celery -A proj pgqueue queues [--json]
    celery -A proj pgqueue dead list [--queue Q] [--reason R] [--limit N] [--json]
    celery -A proj pgqueue dead show ID
    celery -A proj pgqueue dead requeue ID... | --all [--queue Q] [--reason R]
    celery -A proj pgqueue dead purge [--queue Q] [--reason R] [--older-than 7d] --yes
    celery -A proj pgqueue purge QUEUE... --yes
    celery -A proj pgqueue delete QUEUE... --yes
    celery -A proj pgqueue metrics [--port 9808] [--schema S] [--interval 10] [--cap 10000]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import click
import psycopg

from kombu_pgqueue import admin
from kombu_pgqueue.exceptions import ConfigurationError

from ._kombu import json_loads as _loads


def _broker(ctx: click.Context, **overrides: Any) -> admin.Broker:
    """The app's broker; ``overrides`` replace its transport options."""
    conn = ctx.obj.app.connection_for_write()
    try:
        return admin.Broker.from_connection(conn, **overrides)
    except ConfigurationError as exc:  # not a pgqueue broker, or a bad transport option
        raise click.UsageError(str(exc)) from exc
    finally:
        conn.release()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Format rows as a plain aligned text table."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


#: seconds in each unit of a duration
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``"7d"``, ``"12h"``, ``"1d12h"``, ``"90m"``, ``"30s"``, ``"2w"`` as a timedelta."""
    spec = text.strip().lower()
    parts = _DURATION.findall(spec)
    if not parts or "".join(n + u for n, u in parts) != spec:
        raise ValueError(
            f"{text!r} is not a duration: a number and a unit (s, m, h, d, w), e.g. 7d or 1d12h"
        )
    return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> timedelta | None:
    """Click callback: a duration option's text as a timedelta."""
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc


#: the widest error the dead letter table shows (dead show has it whole)
_ERROR_WIDTH = 60


def _short(error: str | None) -> str:
    line = (error or "").strip().splitlines()[-1:] or [""]
    return line[0] if len(line[0]) <= _ERROR_WIDTH else line[0][: _ERROR_WIDTH - 3] + "..."


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _dead_dict(dead: admin.DeadLetter, *, body: bool = False) -> dict[str, Any]:
    headers = _loads(dead.headers)
    found = {
        "id": dead.id,
        "queue": dead.queue,
        "task": headers.get("task"),
        "task_id": headers.get("id"),
        "argsrepr": headers.get("argsrepr"),
        "kwargsrepr": headers.get("kwargsrepr"),
        "retries": headers.get("retries"),
        "reason": dead.reason,
        "error": dead.error,
        "attempts": dead.attempts,
        "priority": dead.priority,
        "created_at": dead.created_at.isoformat(),
        "died_at": dead.died_at.isoformat(),
    }
    if body:
        found["traceback"] = dead.traceback
        found["headers"] = headers
        found["properties"] = _loads(dead.properties)
        found["content_type"] = dead.content_type
        try:
            found["body"] = bytes(dead.body).decode(dead.content_encoding or "utf-8")
        except (UnicodeDecodeError, LookupError):
            found["body"] = bytes(dead.body).hex()
    return found


class _Commands(click.Group):
    """The commands, each ending in one line when the broker's database cannot be reached
    (instead of psycopg's traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
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
    """Install or upgrade the broker schema."""
    broker = _broker(ctx)
    applied = broker.migrate()
    done = ", ".join(map(str, applied)) or "nothing (already current)"
    click.echo(f"schema {broker.schema!r} in {where(broker.conninfo)}: applied {done}")


@pgqueue.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def queues(ctx: click.Context, as_json: bool) -> None:
    """Per queue: ready, delayed (ETA), leased (in flight), dead, oldest ready age."""
    stats = _broker(ctx).queue_stats()
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


@pgqueue.command()
@click.argument("queue_names", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_context
def purge(ctx: click.Context, queue_names: tuple[str, ...], yes: bool) -> None:
    """Delete the waiting messages of QUEUE... (leased ones stay with their consumer)."""
    if not yes:
        click.confirm(f"Delete every waiting message in {', '.join(queue_names)}?", abort=True)
    _each_queue(ctx, queue_names, lambda broker, name: f"purged {broker.purge(name)} messages")


@pgqueue.command()
@click.argument("queue_names", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="do not ask")
@click.option("--force", is_flag=True, help="delete a queue that a consumer uses too")
@click.pass_context
def delete(ctx: click.Context, queue_names: tuple[str, ...], yes: bool, force: bool) -> None:
    """Delete QUEUE...: the declaration, bindings and every message (dead letters stay).

    A queue that a consumer uses (holds one of its messages, or waits for it) is left
    alone unless --force. Stop the queue's publishers and workers first: a publisher that
    declared it before sends to it through an exchange that no longer routes there, and
    those messages are dropped as unroutable until it restarts."""
    if not yes:
        click.confirm(
            f"Delete {', '.join(queue_names)} with every message"
            f"{', in flight too' if force else ''}? Publishers still running drop what "
            "they send to it",
            abort=True,
        )
    in_use: list[str] = []

    def act(broker: admin.Broker, name: str) -> str:
        deleted = broker.delete_queue(name, if_unused=not force)
        if deleted is None:
            in_use.append(name)
            return (
                "not deleted: a consumer uses it (holds one of its messages, or waits for "
                "it); stop its workers first, or --force"
            )
        return f"deleted with {deleted} messages"

    _each_queue(ctx, queue_names, act)
    if in_use:
        raise click.exceptions.Exit(1)


def _each_queue(
    ctx: click.Context, queue_names: Sequence[str], act: Callable[[admin.Broker, str], str]
) -> None:
    """``act`` on each queue that exists, a line for each; exit 1 if one does not."""
    broker = _broker(ctx)
    unknown = [name for name in queue_names if not broker.queue_exists(name)]
    for name in queue_names:
        if name in unknown:
            click.echo(f"{name}: no such queue in schema {broker.schema!r}", err=True)
        else:
            click.echo(f"{name}: {act(broker, name)}")
    if unknown:
        raise click.exceptions.Exit(1)


@pgqueue.group()
def dead() -> None:
    """Dead letters: rejected messages, messages out of attempts and, with the setting
    pgqueue_keep_failed, tasks that failed for good (reason failed)."""


_REASON = click.option(
    "--reason",
    default=None,
    help="only this reason: failed, rejected, max_attempts, consumer_error, undecodable, ...",
)


@dead.command("list")
@click.option("--queue", default=None, help="only this queue")
@_REASON
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def dead_list(
    ctx: click.Context, queue: str | None, reason: str | None, limit: int, as_json: bool
) -> None:
    """List dead letters, oldest first."""
    found = [_dead_dict(d) for d in _broker(ctx).dead_letters(queue, limit, reason=reason)]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    keys = ("id", "queue", "task", "task_id", "reason", "attempts", "died_at")
    rows = [[d[k] for k in keys] + [_short(d["error"])] for d in found]
    click.echo(table((*keys, "error"), rows))


@dead.command("show")
@click.argument("message_id", type=int)
@click.pass_context
def dead_show(ctx: click.Context, message_id: int) -> None:
    """Show one dead letter in full (traceback, headers, properties, body)."""
    found = _broker(ctx).dead_letter(message_id)
    if found is None:
        raise click.ClickException(f"no dead letter with id {message_id}")
    click.echo(json.dumps(_dead_dict(found, body=True), indent=2, default=str))


@dead.command("requeue")
@click.argument("message_ids", nargs=-1, type=int)
@click.option(
    "--all", "everything", is_flag=True, help="every dead letter (of --queue, of --reason)"
)
@click.option("--queue", default=None)
@_REASON
@click.pass_context
def dead_requeue(
    ctx: click.Context,
    message_ids: tuple[int, ...],
    everything: bool,
    queue: str | None,
    reason: str | None,
) -> None:
    """Put dead letters back in their queues, with their attempts reset. A task runs
    again with its task id, so its result is overwritten."""
    if not message_ids and not everything:
        raise click.UsageError("name dead letter ids, or pass --all")
    broker = _broker(ctx)
    ids = list(message_ids)
    if everything:
        ids = [d.id for d in broker.dead_letters(queue, limit=None, reason=reason)]
    queues_hit = broker.requeue_dead(ids)
    # a letter whose dedup key a live message holds stays dead rather than run twice
    asked = set(ids)
    stayed = [d.id for d in broker.dead_letters(queue, limit=None) if d.id in asked]
    done = len(ids) - len(stayed)
    line = f"requeued {done} dead letters into {', '.join(queues_hit) or 'no queue'}"
    if stayed:
        line += f"; {len(stayed)} stayed dead, their dedup key is taken: {stayed}"
    click.echo(line)


@dead.command("purge")
@click.option("--queue", default=None)
@_REASON
@click.option(
    "--older-than",
    default=None,
    metavar="DURATION",
    callback=_duration,
    help="only those dead for longer than this: 30m, 12h, 7d, 2w, 1d12h",
)
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_context
def dead_purge(
    ctx: click.Context,
    queue: str | None,
    reason: str | None,
    older_than: timedelta | None,
    yes: bool,
) -> None:
    """Delete dead letters for good."""
    if not yes:
        which = f"the dead letters of {queue or 'every queue'}"
        if reason:
            which += f" with reason {reason}"
        if older_than is not None:
            which += f" that died over {older_than} ago"
        click.confirm(f"Delete {which} for good?", abort=True)
    deleted = _broker(ctx).purge_dead(queue, reason=reason, older_than=older_than)
    click.echo(f"deleted {deleted} dead letters")


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
    serve_forever(_broker(ctx, **overrides).monitor(cap=cap), port, addr, interval)
