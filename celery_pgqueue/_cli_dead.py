"""``celery pgqueue dead ...``: list, show, requeue and purge dead letters."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

import click

from kombu_pgqueue import admin

from ._cli_common import broker_of, table
from ._kombu import json_loads as _loads

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


def _dead_dict(dead: admin.DeadLetter, *, body: bool = False) -> dict[str, Any]:
    headers = _loads(dead.headers)
    found = {
        "id": dead.id,
        "queue": dead.queue,
        "task": headers.get("task"),
        "task_id": dead.task_id,
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


@click.group()
def dead() -> None:
    """Dead letters: rejected messages, messages out of attempts and tasks that failed
    for good (reason failed; kept for 7 days by configure(), setting pgqueue_keep_failed)."""


#: why a message is dead (the dead_letter table's reason column)
REASONS = ("failed", "rejected", "max_attempts", "consumer_error", "undecodable")

_REASON = click.option(
    "--reason",
    default=None,
    type=click.Choice(REASONS),
    help="only dead letters of this reason",
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
    found = [_dead_dict(d) for d in broker_of(ctx).dead_letters(queue, limit, reason=reason)]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    keys = ("id", "queue", "task", "task_id", "reason", "attempts", "died_at")
    rows = [[d[k] for k in keys] + [_short(d["error"])] for d in found]
    click.echo(table((*keys, "error"), rows))


@dead.command("show")
@click.argument("message_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def dead_show(ctx: click.Context, message_id: int, as_json: bool) -> None:
    """Show one dead letter in full (headers, properties, body, then its traceback)."""
    found = broker_of(ctx).dead_letter(message_id)
    if found is None:
        raise click.ClickException(f"no dead letter with id {message_id}")
    shown = _dead_dict(found, body=True)
    if as_json:
        click.echo(json.dumps(shown, indent=2, default=str))
        return
    # a traceback reads as Python prints it, not as one escaped JSON string
    traceback = shown.pop("traceback")
    click.echo(json.dumps(shown, indent=2, default=str))
    if traceback:
        click.echo("\n" + str(traceback).rstrip("\n"))


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
    broker = broker_of(ctx)
    unknown: list[int] = []
    if everything:
        ids = [d.id for d in broker.dead_letters(queue, limit=None, reason=reason)]
    else:  # named ones are looked up (a round trip each): a mistyped id is not a success
        unknown = [i for i in dict.fromkeys(message_ids) if broker.dead_letter(i) is None]
        for i in unknown:
            click.echo(f"no dead letter with id {i}", err=True)
        ids = [i for i in message_ids if i not in unknown]
    queues_hit = broker.requeue_dead(ids)
    # a letter whose dedup key a live message holds stays dead rather than run twice
    asked = set(ids)
    stayed = [d.id for d in broker.dead_letters(queue, limit=None) if d.id in asked]
    done = len(ids) - len(stayed)
    line = f"requeued {done} dead letters into {', '.join(queues_hit) or 'no queue'}"
    if stayed:
        line += f"; {len(stayed)} stayed dead, their dedup key is taken: {stayed}"
    click.echo(line)
    if unknown:
        raise click.exceptions.Exit(1)


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
    deleted = broker_of(ctx).purge_dead(queue, reason=reason, older_than=older_than)
    click.echo(f"deleted {deleted} dead letters")
