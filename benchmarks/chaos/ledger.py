"""The ledger: what was published, what ran (and where, when), and what was done to it.

Tables live in schema ``chaos_ledger``, apart from the broker's schema, one set per run:

* ``"<run>_published"``: every task id a producer believes it published.
* ``"<run>_exec"``: one row per execution (task id, worker, pid, start, end; how its
  message came: handed off or claimed, the message's id and attempt).
* ``"<run>_event"``: kills, database restarts and worker-ready notes, with their time.

:func:`analyse` turns them into the figures a scenario prints.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from .app import LEDGER_SCHEMA


def new_run() -> str:
    return uuid.uuid4().hex[:8]


def tables(run: str) -> dict[str, sql.Identifier]:
    return {
        kind: sql.Identifier(LEDGER_SCHEMA, f"{run}_{kind}")
        for kind in ("published", "exec", "event")
    }


def create(conn: psycopg.Connection, run: str) -> None:
    t = tables(run)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(LEDGER_SCHEMA)))
    conn.execute(sql.SQL("CREATE TABLE {} (task_id text PRIMARY KEY)").format(t["published"]))
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {} (
                run_id text PRIMARY KEY,
                task_id text NOT NULL,
                worker text NOT NULL,
                pid integer NOT NULL,
                started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                finished_at timestamptz,
                handoff boolean,
                message_id bigint,
                attempts integer
            )
            """
        ).format(t["exec"])
    )
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {} (
                at timestamptz NOT NULL DEFAULT clock_timestamp(),
                kind text NOT NULL,
                worker text,
                pid integer
            )
            """
        ).format(t["event"])
    )


def drop(conn: psycopg.Connection, run: str) -> None:
    # and the load scenario's table of consumed messages
    for table in [*tables(run).values(), load_table(run)]:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))


def record_published(conn: psycopg.Connection, run: str, task_ids: Iterable[str]) -> None:
    with conn.cursor() as cur:
        with cur.copy(
            sql.SQL("COPY {} (task_id) FROM STDIN").format(tables(run)["published"])
        ) as cp:
            for task_id in task_ids:
                cp.write_row((task_id,))


def record_event(
    conn: psycopg.Connection,
    run: str,
    kind: str,
    worker: str | None = None,
    pid: int | None = None,
    at: datetime | None = None,
) -> None:
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (at, kind, worker, pid) "
            "VALUES (coalesce(%s::timestamptz, clock_timestamp()), %s, %s, %s)"
        ).format(tables(run)["event"]),
        (at, kind, worker, pid),
    )


def load_table(run: str) -> sql.Identifier:
    """``"<run>_load"``: one row (p, s) per message a Kombu consumer of the load and
    snapshot scenarios took (producer or kind, sequence number)."""
    return sql.Identifier(LEDGER_SCHEMA, f"{run}_load")


def create_load_table(conn: psycopg.Connection, run: str) -> None:
    table = load_table(run)
    conn.execute(sql.SQL("CREATE TABLE {} (p int NOT NULL, s int NOT NULL)").format(table))


@dataclass
class Tally:
    """The load table against what was published: rows, distinct (p, s), and the keys
    never consumed (lost) and consumed but never published (unexpected)."""

    rows: int
    distinct: int
    lost: int
    unexpected: int

    @property
    def duplicated(self) -> int:
        return self.rows - self.distinct


def tally(conn: psycopg.Connection, run: str, expected: set[tuple[int, int]]) -> Tally:
    table = load_table(run)
    rows = count(conn, sql.SQL("SELECT count(*) FROM {}").format(table))
    with conn.transaction():
        # by sorting: PostgreSQL 15's hashed DISTINCT of the 1.29 million rows of a
        # quick snapshot (one producer, so nearly every row its own group, against an
        # estimate of 40,000) ran for ten minutes; sorted, 0.6 s
        conn.execute("SET LOCAL enable_hashagg = off")
        query = sql.SQL("SELECT DISTINCT p, s FROM {}").format(table)
        got = {(p, s) for p, s in conn.execute(query)}
    return Tally(rows, len(got), len(expected - got), len(got - expected))


def count(conn: psycopg.Connection, query: sql.Composable, params: tuple[Any, ...] = ()) -> int:
    row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


def finished_count(conn: psycopg.Connection, run: str) -> int:
    return count(
        conn,
        sql.SQL("SELECT count(DISTINCT task_id) FROM {} WHERE finished_at IS NOT NULL").format(
            tables(run)["exec"]
        ),
    )


@dataclass
class Figures:
    published: int = 0
    executed: int = 0  # published tasks with at least one finished execution
    executions: int = 0  # execution rows of published tasks, finished or cut short
    lost: int = 0  # published, never finished, not dead-lettered
    dead_lettered: int = 0
    duplicated: int = 0  # tasks with more than one execution
    extra_executions: int = 0
    overlapping: int = 0  # duplicated tasks with two executions at once (or unknown end)
    explained: int = 0  # duplicated tasks whose every extra execution a kill explains
    by_crash: int = 0  # of those, explained only by a worker that crashed by itself
    unexplained: list[str] = field(default_factory=list)
    lost_ids: list[str] = field(default_factory=list)
    # how executions' messages came (NULL in the ledger: the task did not say)
    by_handoff: int = 0  # executions of a handed-off delivery
    by_claim: int = 0  # executions of a claimed one
    first_by_handoff: int = 0  # of each executed task's first execution
    firsts: int = 0  # published tasks with at least one execution
    duplicated_after_handoff: int = 0  # duplicated tasks with a handed-off earlier execution
    explained_after_handoff: int = 0  # of those, explained by a kill/restart/crash

    def handoff_share(self) -> float:
        """The share of first executions whose delivery was a handoff."""
        return self.first_by_handoff / self.firsts if self.firsts else 0.0

    def ok(self, *, allow_duplicates: bool = True) -> bool:
        return (
            self.lost == 0
            and self.overlapping == 0
            and not self.unexplained
            and (allow_duplicates or self.duplicated == 0)
        )

    def rows(self) -> list[tuple[str, Any]]:
        return [
            ("published", self.published),
            ("executed (finished at least once)", self.executed),
            ("executions (rows)", self.executions),
            ("lost", self.lost),
            ("dead-lettered", self.dead_lettered),
            ("executed more than once", self.duplicated),
            ("extra executions", self.extra_executions),
            ("duplicates overlapping in time", self.overlapping),
            ("duplicates explained by a kill/restart", self.explained - self.by_crash),
            ("duplicates explained by a worker crash", self.by_crash),
            ("duplicates NOT explained", len(self.unexplained)),
        ] + (self.handoff_rows() if self.by_handoff or self.by_claim else [])

    def handoff_rows(self) -> list[tuple[str, Any]]:
        return [
            ("executions by handoff / by claim", f"{self.by_handoff} / {self.by_claim}"),
            (
                "first executions by handoff",
                f"{self.first_by_handoff} of {self.firsts} ({self.handoff_share():.1%})",
            ),
            (
                "duplicates with a handed-off earlier execution (explained)",
                f"{self.duplicated_after_handoff} ({self.explained_after_handoff})",
            ),
        ]


#: how long after a kill the server may still write the start row the killed process
#: had sent (measured: up to 2 ms under the chaos runs' load)
START_IN_FLIGHT = timedelta(milliseconds=100)


def _cause(run: dict[str, Any], nxt: dict[str, Any], events: list[dict[str, Any]]) -> Any:
    """The last event that cut ``run`` short before ``nxt`` started, or None.

    A child kill explains the runs of that pid; a main-process kill (or the group
    kill of its orphans, or the worker exiting by itself) every run on that worker;
    a database restart every run.

    A kill may come while the run's start row is on its way: the server then writes a
    start a moment after the kill's time (read on this machine right after the signal).
    A kill up to START_IN_FLIGHT before the start still explains the run.
    """
    found = None
    for event in events:
        if not (run["started_at"] - START_IN_FLIGHT <= event["at"] <= nxt["started_at"]):
            continue
        if event["kind"] == "dbrestart":
            if run["started_at"] <= event["at"]:
                found = event
        elif event["worker"] == run["worker"] and (
            event["kind"] in ("main", "orphans", "crash") or event["pid"] == run["pid"]
        ):
            found = event
    return found


def analyse(conn: psycopg.Connection, run: str, broker_schema: str) -> Figures:
    t = tables(run)
    published = {
        r[0] for r in conn.execute(sql.SQL("SELECT task_id FROM {}").format(t["published"]))
    }
    dead = {
        r[0]
        for r in conn.execute(
            sql.SQL("SELECT headers->>'id' FROM {}").format(
                sql.Identifier(broker_schema, "dead_letter")
            )
        )
    }
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        executions = cur.execute(
            sql.SQL("SELECT * FROM {} ORDER BY started_at").format(t["exec"])
        ).fetchall()
        events = cur.execute(
            sql.SQL("SELECT * FROM {} WHERE kind <> 'ready' ORDER BY at").format(t["event"])
        ).fetchall()
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in executions:
        by_task.setdefault(row["task_id"], []).append(row)

    fig = Figures(published=len(published))
    for task_id in published:
        runs = by_task.get(task_id, [])
        fig.executions += len(runs)
        fig.by_handoff += sum(r["handoff"] is True for r in runs)
        fig.by_claim += sum(r["handoff"] is False for r in runs)
        if runs:
            fig.firsts += 1
            fig.first_by_handoff += runs[0]["handoff"] is True
        if any(r["finished_at"] is not None for r in runs):
            fig.executed += 1
        elif task_id in dead:
            fig.dead_lettered += 1
        else:
            fig.lost += 1
            fig.lost_ids.append(task_id)
        if len(runs) < 2 or task_id in dead:
            continue
        fig.duplicated += 1
        fig.extra_executions += len(runs) - 1
        explained, overlapping, crash = True, False, False
        for run, nxt in zip(runs, runs[1:]):
            cause = _cause(run, nxt, events)
            if cause is None:
                explained = False
            elif cause["kind"] == "crash":
                crash = True
            end = run["finished_at"]
            if end is None and cause is not None:
                end = cause["at"]  # the process died then (orphans: killed with the group)
            if end is None or end > nxt["started_at"]:
                overlapping = True
        fig.explained += explained
        fig.by_crash += explained and crash
        if any(r["handoff"] for r in runs[:-1]):
            fig.duplicated_after_handoff += 1
            fig.explained_after_handoff += explained
        fig.overlapping += overlapping
        if not explained:
            fig.unexplained.append(task_id)
    return fig


def broker_leftovers(conn: psycopg.Connection, schema: str) -> int:
    return count(
        conn, sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message_store"))
    )
