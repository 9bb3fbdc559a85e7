"""Chaos scenario ``atomic``: exactly-once effects of atomic tasks under SIGKILLs.

N tasks (``--tasks``; default 20,000, quick 2,000; the issue's full run is 100,000) of
``chaos.atomic``, a :class:`celery_pgqueue.AtomicTask` that inserts one row keyed by its
task id into ``<schema>.effect`` with a plain INSERT (no unique key, no ON CONFLICT), on
2 prefork workers x 3 processes. Every 2-3 s a random worker loses its main process
(30 %, then its orphaned pool children a second later, and a new worker is started) or
a pool child. Pass: every published task has exactly one effect row, 0 lost, every
repeated execution explained by a kill, no worker exits by itself.

The workers run ``celery -A benchmarks.chaos.atomic worker``: the app of
:mod:`benchmarks.chaos.app` (its ledger, ``acks_late``) with the atomic task added. Each
execution writes its start to the ledger in autocommit, as every chaos task does, and its
end through ``self.db``: the end, the effect and the ack commit together, so "executed"
means committed, and an execution cut short by a kill has no end.
"""

from __future__ import annotations

import random
import time
from typing import Any

import psycopg
from psycopg import sql

from celery_pgqueue.atomic import AtomicTask

from . import ledger, procs
from .app import LedgerWriter, lazy_app, make_app
from .celery_scenarios import Killer, _publish_bulk, _wait_drained
from .context import Context, Result

#: SIGKILLs come every KILL_EVERY seconds, at random within
KILL_EVERY = (2.0, 3.0)
WORKERS, CONCURRENCY, PREFETCH = 2, 3, 4


def make_atomic_app(dsn: str, schema: str, run: str, options: dict[str, Any], prefetch: int) -> Any:
    """The chaos app with ``chaos.atomic``: one effect row per committed execution."""
    app = make_app(dsn, schema, run, options, prefetch)
    writer = LedgerWriter(dsn, run)
    effect = sql.SQL("INSERT INTO {} (task_id) VALUES (%s)").format(
        sql.Identifier(schema, "effect")
    )
    finish = sql.SQL("UPDATE {} SET finished_at = clock_timestamp() WHERE run_id = %s").format(
        writer.exec_table
    )

    @app.task(bind=True, base=AtomicTask, name="chaos.atomic", shared=False)
    def atomic(self: Any, seconds: float = 0.0) -> None:
        run_id = writer.start(self.request.id, self.request.hostname or "")
        self.db.execute(effect, (self.request.id,))
        if seconds:
            time.sleep(seconds)
        self.db.execute(finish, (run_id,))

    return app


class AtomicFleet(procs.Fleet):
    """A :class:`procs.Fleet` whose workers run this module's app."""

    app = __name__


def _effect_counts(conn: psycopg.Connection, schema: str, run_id: str) -> dict[str, int]:
    """How many published tasks have 0, 1 or more effect rows, and effects of no task."""
    row = conn.execute(
        sql.SQL(
            """
            WITH per_task AS (
                SELECT p.task_id, count(e.task_id) AS effects
                FROM {published} AS p
                LEFT JOIN {effect} AS e ON e.task_id = p.task_id
                GROUP BY p.task_id
            )
            SELECT
                count(*) FILTER (WHERE effects = 0),
                count(*) FILTER (WHERE effects = 1),
                count(*) FILTER (WHERE effects > 1),
                (SELECT count(*) FROM {effect} AS e
                 WHERE NOT EXISTS (SELECT 1 FROM {published} AS p WHERE p.task_id = e.task_id))
            FROM per_task
            """
        ).format(
            published=ledger.tables(run_id)["published"], effect=sql.Identifier(schema, "effect")
        )
    ).fetchone()
    assert row is not None
    return dict(zip(("none", "once", "twice", "stray"), (int(v) for v in row)))


def atomic(ctx: Context) -> Result:
    n = ctx.tasks or (2000 if ctx.quick else 20_000)
    rng = random.Random(11)
    with ctx.run("atomic") as run, run.connect() as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (task_id text NOT NULL)").format(
                sql.Identifier(run.schema, "effect")
            )
        )
        options = {"visibility_timeout": 10, "polling_interval": 2}
        fleet = AtomicFleet(
            ctx.url_dsn, run.schema, run.run_id, ctx.logs, options, CONCURRENCY, PREFETCH
        )
        run.fleets.append(fleet)
        for _ in range(WORKERS):
            fleet.spawn()
        app = run.app()
        specs = [("chaos.atomic", (_work_seconds(rng),)) for _ in range(n)]
        publisher = _publish_bulk(run, app, specs)
        kills = Killer(run, conn, fleet, rng, every=KILL_EVERY)
        drained = _wait_drained(run, conn, publisher, timeout=max(600, n / 20), tick=kills.tick)
        fleet.stop()
        fig = ledger.analyse(conn, run.run_id, run.schema)
        effects = _effect_counts(conn, run.schema, run.run_id)
        late = sum(w.log_tail(10**7).count("lease ended") for w in fleet.workers)
        ok = (
            drained
            and fig.ok()
            and effects["once"] == n
            and effects["twice"] == effects["none"] == effects["stray"] == 0
            and not kills.counts["crashed"]
        )
        result = Result("atomic", ok, fig, seconds=run.elapsed())
        result.measures += [
            ("tasks", n),
            ("tasks with exactly one effect row", effects["once"]),
            ("effects applied twice", effects["twice"]),
            ("tasks without their effect", effects["none"]),
            ("effect rows of no published task", effects["stray"]),
            ("SIGKILLs of main processes", kills.counts["main"]),
            ("SIGKILLs of pool children", kills.counts["child"]),
            ("workers that exited by themselves", kills.counts["crashed"]),
            ("workers started", fleet.started),
            ("'lease ended' warnings (late acks)", late),
            ("drained (no message left)", drained),
        ]
        return result


def _work_seconds(rng: random.Random) -> float:
    # mostly short tasks, some long enough that a kill often lands in their transaction
    return rng.uniform(0.0, 0.01) if rng.random() < 0.95 else rng.uniform(0.2, 1.0)


__getattr__ = lazy_app(globals(), make_atomic_app)
