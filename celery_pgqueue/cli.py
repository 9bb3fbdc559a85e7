"""``celery pgqueue ...``: broker commands added to Celery's CLI (entry point ``celery.commands``).

::

    celery -A proj pgqueue migrate
    celery -A proj pgqueue queues [--json]
    celery -A proj pgqueue dead list [--queue Q] [--limit N] [--json]
    celery -A proj pgqueue dead show ID
    celery -A proj pgqueue dead requeue ID... | --all [--queue Q]
    celery -A proj pgqueue dead purge [--queue Q] --yes
    celery -A proj pgqueue purge QUEUE... --yes
    celery -A proj pgqueue metrics [--port 9808] [--schema S] [--interval 10] [--cap 10000]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

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
        "reason": dead.reason,
        "error": dead.error,
        "attempts": dead.attempts,
        "priority": dead.priority,
        "created_at": dead.created_at.isoformat(),
        "died_at": dead.died_at.isoformat(),
    }
    if body:
        found["headers"] = headers
        found["properties"] = _loads(dead.properties)
        found["content_type"] = dead.content_type
        try:
            found["body"] = bytes(dead.body).decode(dead.content_encoding or "utf-8")
        except (UnicodeDecodeError, LookupError):
            found["body"] = bytes(dead.body).hex()
    return found


@click.group(name="pgqueue")
def pgqueue() -> None:
    """pgqueue broker: schema, queue sizes and dead letters."""


@pgqueue.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Install or upgrade the broker schema."""
    broker = _broker(ctx)
    applied = broker.migrate()
    done = ", ".join(map(str, applied)) or "nothing (already current)"
    click.echo(f"schema {broker.schema!r}: applied {done}")


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
    broker = _broker(ctx)
    for name in queue_names:
        click.echo(f"{name}: purged {broker.purge(name)} messages")


@pgqueue.group()
def dead() -> None:
    """Dead letters: rejected messages and messages out of attempts."""


@dead.command("list")
@click.option("--queue", default=None, help="only this queue")
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def dead_list(ctx: click.Context, queue: str | None, limit: int, as_json: bool) -> None:
    """List dead letters, oldest first."""
    found = [_dead_dict(d) for d in _broker(ctx).dead_letters(queue, limit)]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    keys = ("id", "queue", "task", "task_id", "reason", "attempts", "died_at")
    click.echo(table(keys, [[d[k] for k in keys] for d in found]))


@dead.command("show")
@click.argument("message_id", type=int)
@click.pass_context
def dead_show(ctx: click.Context, message_id: int) -> None:
    """Show one dead letter in full (headers, properties, body)."""
    found = _broker(ctx).dead_letter(message_id)
    if found is None:
        raise click.ClickException(f"no dead letter with id {message_id}")
    click.echo(json.dumps(_dead_dict(found, body=True), indent=2, default=str))


@dead.command("requeue")
@click.argument("message_ids", nargs=-1, type=int)
@click.option("--all", "everything", is_flag=True, help="every dead letter (of --queue)")
@click.option("--queue", default=None)
@click.pass_context
def dead_requeue(
    ctx: click.Context, message_ids: tuple[int, ...], everything: bool, queue: str | None
) -> None:
    """Put dead letters back in their queues, with their attempts reset."""
    if not message_ids and not everything:
        raise click.UsageError("name dead letter ids, or pass --all")
    broker = _broker(ctx)
    ids = list(message_ids)
    if everything:
        ids = [d.id for d in broker.dead_letters(queue, limit=None)]
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
@click.option("--yes", is_flag=True, help="do not ask")
@click.pass_context
def dead_purge(ctx: click.Context, queue: str | None, yes: bool) -> None:
    """Delete dead letters for good."""
    if not yes:
        click.confirm(f"Delete the dead letters of {queue or 'every queue'} for good?", abort=True)
    click.echo(f"deleted {_broker(ctx).purge_dead(queue)} dead letters")


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
