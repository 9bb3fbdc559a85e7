"""What the ``celery pgqueue`` commands share: the app's broker, and a text table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from kombu_pgqueue import admin
from kombu_pgqueue.exceptions import ConfigurationError


def broker_of(ctx: click.Context, **overrides: Any) -> admin.Broker:
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
