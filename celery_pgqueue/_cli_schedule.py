"""``celery pgqueue schedule ...``: the periodic entries of ``celery_pgqueue.beat``.

::

    celery -A proj pgqueue schedule list [--json]
    celery -A proj pgqueue schedule add NAME TASK (--every 30 | --crontab '*/5 * * * *'
        | --solar sunset:48.85:2.35) [--args JSON] [--kwargs JSON] [--queue Q]
        [--options JSON] [--missed once|skip]
    celery -A proj pgqueue schedule pause|resume|remove NAME

Changes take effect at the leading beat's next tick (``pgqueue_beat_poll_interval``, 1 s),
without a restart.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click
from celery.exceptions import ImproperlyConfigured

from kombu_pgqueue.schedule import Entry, EntrySpec, Leader

from ._cli_common import broker_of, table
from ._schedules import Clock, from_json, next_due


def describe(data: dict[str, Any]) -> str:
    """A stored schedule in a few words: ``every 10s``, ``cron 0 4 * * *``..."""
    kind = data.get("kind")
    if kind == "interval":
        every = float(data["every"])
        text = f"every {every:g}s"
        return text + " (relative)" if data.get("relative") else text
    if kind == "crontab":
        fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return "cron " + " ".join(_cron_text(data.get(f, "*")) for f in fields)
    if kind == "solar":
        return f"solar {data['event']} {data['lat']},{data['lon']}"
    return json.dumps(data)


def _cron_text(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _next_run(app: Any, entry: Entry, clock: Clock) -> datetime | None:
    if not entry.enabled:
        return None
    try:
        return next_due(from_json(entry.schedule, app, clock), entry.last_due, clock)
    except (ValueError, KeyError, ImproperlyConfigured):  # solar without ephem, a bad entry
        return None


def _leader_line(leader: Leader | None) -> str:
    if leader is None:
        return "leader: none (no beat of celery_pgqueue.beat:Scheduler is running)"
    return f"leader: {leader.node} (since {_when(leader.since)})"


@click.group()
def schedule() -> None:
    """Periodic tasks of celery_pgqueue.beat:Scheduler, kept in the broker's database."""


@schedule.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """Each entry's schedule, last and next run, counts; and which beat leads."""
    broker = broker_of(ctx)
    entries, leader = broker.periodic_entries(), broker.beat_leader()
    app = ctx.obj.app
    clock = Clock()
    clock.now = app.now()
    nexts = {e.name: _next_run(app, e, clock) for e in entries}
    if as_json:
        click.echo(
            json.dumps(
                {
                    "leader": None
                    if leader is None
                    else {"node": leader.node, "since": _when(leader.since)},
                    "entries": [
                        {
                            "name": e.name,
                            "task": e.task,
                            "schedule": e.schedule,
                            "args": e.args,
                            "kwargs": e.kwargs,
                            "options": e.options,
                            "missed": e.missed,
                            "enabled": e.enabled,
                            "origin": e.origin,
                            "last_due": _when(e.last_due),
                            "last_run_at": _when(e.last_run_at),
                            "next_run_at": _when(nexts[e.name]),
                            "total_run_count": e.total_run_count,
                            "late_count": e.late_count,
                            "last_lateness": e.last_lateness,
                        }
                        for e in entries
                    ],
                },
                indent=2,
            )
        )
        return
    click.echo(_leader_line(leader))
    if not entries:
        click.echo("no periodic entries")
        return
    rows = [
        (
            e.name,
            e.task,
            describe(e.schedule),
            "active" if e.enabled else "paused",
            _when(e.last_run_at),
            _when(nexts[e.name]),
            e.total_run_count,
            e.late_count,
            e.origin,
        )
        for e in entries
    ]
    headers = ("name", "task", "schedule", "state", "last run", "next run", "runs", "late")
    click.echo(table((*headers, "from"), rows))


def _schedule_json(every: float | None, cron: str | None, sun: str | None) -> dict[str, Any]:
    given = [v for v in (every, cron, sun) if v is not None]
    if len(given) != 1:
        raise click.UsageError("give one of --every, --crontab, --solar")
    if every is not None:
        if every <= 0:
            raise click.BadParameter("must be more than 0", param_hint="--every")
        return {"kind": "interval", "every": every, "relative": False}
    if cron is not None:
        fields = cron.split()
        if len(fields) != 5:
            raise click.BadParameter(
                "five fields: minute hour day-of-month month day-of-week", param_hint="--crontab"
            )
        names = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return {"kind": "crontab", **dict(zip(names, fields))}
    assert sun is not None
    try:
        event, lat, lon = sun.split(":")
        return {"kind": "solar", "event": event, "lat": float(lat), "lon": float(lon)}
    except ValueError:
        raise click.BadParameter("EVENT:LATITUDE:LONGITUDE", param_hint="--solar") from None


def _json_option(value: str | None, kind: type, hint: str) -> Any:
    if value is None:
        return kind()
    try:
        found = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=hint) from exc
    if not isinstance(found, kind):
        raise click.BadParameter(f"a JSON {kind.__name__}", param_hint=hint)
    return found


@schedule.command()
@click.argument("name")
@click.argument("task")
@click.option("--every", type=float, help="Seconds between due times.")
@click.option("--crontab", "cron", help="'minute hour day-of-month month day-of-week'.")
@click.option("--solar", "sun", help="EVENT:LATITUDE:LONGITUDE (needs ephem).")
@click.option("--args", "args_json", help="Positional arguments, a JSON list.")
@click.option("--kwargs", "kwargs_json", help="Keyword arguments, a JSON object.")
@click.option("--options", "options_json", help="apply_async options, a JSON object.")
@click.option("--queue", help="The queue to send to (an option).")
@click.option(
    "--missed",
    type=click.Choice(["once", "skip"]),
    default="once",
    show_default=True,
    help="Due times missed while no beat ran: sent once, or skipped.",
)
@click.pass_context
def add(
    ctx: click.Context,
    name: str,
    task: str,
    every: float | None,
    cron: str | None,
    sun: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    options_json: str | None,
    queue: str | None,
    missed: str,
) -> None:
    """Add entry NAME sending TASK, or change it (its last run and pause stay)."""
    options = _json_option(options_json, dict, "--options")
    if queue:
        options["queue"] = queue
    spec = EntrySpec(
        name=name,
        task=task,
        schedule=_schedule_json(every, cron, sun),
        args=_json_option(args_json, list, "--args"),
        kwargs=_json_option(kwargs_json, dict, "--kwargs"),
        options=options,
        missed="skip" if missed == "skip" else "once",
    )
    if spec.schedule["kind"] != "interval":  # what a beat would refuse, refused now
        try:
            from_json(spec.schedule, ctx.obj.app, Clock())
        except ImproperlyConfigured as exc:  # solar needs ephem
            raise click.ClickException(f"{describe(spec.schedule)}: {exc}") from exc
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--crontab/--solar") from exc
    broker = broker_of(ctx)
    known = {e.name for e in broker.periodic_entries()}
    changed = broker.save_periodic(spec)
    click.echo(f"{name}: {'unchanged' if not changed else 'changed' if name in known else 'added'}")


def _one(ctx: click.Context, name: str, act: str) -> None:
    broker = broker_of(ctx)
    done = {
        "pause": broker.pause_periodic,
        "resume": broker.resume_periodic,
        "remove": broker.remove_periodic,
    }[act](name)
    if not done:
        state = " paused" if act == "resume" else ""
        raise click.ClickException(f"no{state} periodic entry named {name!r}")
    click.echo(f"{name}: {act}d")


@schedule.command()
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Stop sending entry NAME until it is resumed."""
    _one(ctx, name, "pause")


@schedule.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Send paused entry NAME again, from its next due time after now."""
    _one(ctx, name, "resume")


@schedule.command()
@click.argument("name")
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    """Remove entry NAME (one of beat_schedule comes back when a beat starts)."""
    _one(ctx, name, "remove")
