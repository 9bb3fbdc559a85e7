"""The ledger of the worker tests' apps (``lifecycle_app``, ``beat_app``): every task
execution written down by the task itself, in its own autocommit transactions, so it
shows every start, even of a process killed next (task id, label, worker hostname, pid,
whether the message came again, start and end time); and the gate table beside it that
``block`` tasks wait on (``helpers.open_gate(..., table="<ledger>_gate")``).
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from helpers import wait_gate
from psycopg import sql
from psycopg.rows import dict_row


def create_ledger(conn: psycopg.Connection, schema: str, ledger: str = "ledger") -> None:
    """Create the ledger and its gate table in ``schema`` (which must exist)."""
    conn.execute(
        sql.SQL(
            """
            CREATE TABLE {ledger} (
                run bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                task_id text NOT NULL,
                label text NOT NULL,
                hostname text NOT NULL,
                pid integer NOT NULL,
                redelivered boolean,
                started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                finished_at timestamptz
            )
            """
        ).format(ledger=sql.Identifier(schema, ledger))
    )
    conn.execute(
        sql.SQL("CREATE TABLE {gate} (name text PRIMARY KEY)").format(
            gate=sql.Identifier(schema, f"{ledger}_gate")
        )
    )


class Ledger:
    """Writes task executions to ``schema.ledger``; shared by a worker's tasks and by the
    in-process tests' tasks."""

    def __init__(self, dsn: str, schema: str, ledger: str = "ledger") -> None:
        self.dsn = dsn
        self.schema = schema
        self.ledger = ledger
        self.table = sql.Identifier(schema, ledger)

    def start(self, task: Any, label: str) -> int:
        """Write down that ``task`` started; return the run number."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (task_id, label, hostname, pid, redelivered) "
                    "VALUES (%s, %s, %s, %s, %s) RETURNING run"
                ).format(self.table),
                (
                    task.request.id,
                    label,
                    task.request.hostname or "",
                    os.getpid(),
                    (task.request.delivery_info or {}).get("redelivered"),
                ),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def finish(self, run: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("UPDATE {} SET finished_at = clock_timestamp() WHERE run = %s").format(
                    self.table
                ),
                (run,),
            )

    def wait_gate(self, gate: str, timeout: float) -> None:
        """Wait until gate ``gate`` is open; fail after ``timeout`` seconds."""
        wait_gate(self.dsn, self.schema, gate, timeout, table=f"{self.ledger}_gate")


def runs(db: psycopg.Connection, schema: str, ledger: str = "ledger") -> list[dict[str, Any]]:
    """Every task execution the ledger saw, in start order."""
    with db.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL("SELECT * FROM {} ORDER BY run").format(sql.Identifier(schema, ledger))
        ).fetchall()
