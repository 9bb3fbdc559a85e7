"""What every scenario gets: the database, the arguments, a fresh broker schema and ledger."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from ..peers import drop_schema
from . import ledger, procs
from .app import make_app


@dataclass
class Result:
    """What a scenario prints: the ledger figures, other measurements, a verdict."""

    name: str
    passed: bool
    figures: ledger.Figures | None = None
    measures: list[tuple[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def print(self) -> None:
        print(f"\n=== {self.name}: {'PASS' if self.passed else 'FAIL'} ({self.seconds:.0f} s)")
        rows = (self.figures.rows() if self.figures else []) + self.measures
        width = max((len(k) for k, _ in rows), default=10)
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
        if self.figures and self.figures.lost_ids:
            print(f"  lost ids (first 10): {self.figures.lost_ids[:10]}")
        if self.figures and self.figures.unexplained:
            print(f"  unexplained duplicates (first 10): {self.figures.unexplained[:10]}")
        for note in self.notes:
            print(f"  note: {note}")


@dataclass
class Context:
    dsn: str
    url_dsn: str
    logs: Path
    tasks: int | None
    minutes: float | None
    quick: bool
    keep: bool = False

    @contextlib.contextmanager
    def run(self, scenario: str) -> Iterator[Run]:
        run_id = ledger.new_run()
        schema = f"chaos_{run_id}"
        procs.create_schema(self.dsn, schema)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            ledger.create(conn, run_id)
        print(
            f'--- {scenario}: schema {schema}, ledger chaos_ledger."{run_id}_*", logs {self.logs}'
        )
        current = Run(self, scenario, run_id, schema)
        try:
            yield current
        finally:
            for fleet in current.fleets:
                fleet.stop()
            for app in current.apps:
                app.close()
            procs.pg_ensure_running()
            if not self.keep:
                drop_schema(self.dsn, schema)
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    ledger.drop(conn, run_id)
                    try:  # the ledger schema too, unless another run still uses it
                        conn.execute("DROP SCHEMA IF EXISTS chaos_ledger")
                    except psycopg.errors.DependentObjectsStillExist:
                        pass


@dataclass
class Run:
    ctx: Context
    scenario: str
    run_id: str
    schema: str
    fleets: list[procs.Fleet] = field(default_factory=list)
    apps: list[Any] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def fleet(
        self, options: dict[str, Any], *, concurrency: int = 3, prefetch: int = 4
    ) -> procs.Fleet:
        fleet = procs.Fleet(
            self.ctx.url_dsn,
            self.schema,
            self.run_id,
            self.ctx.logs,
            options,
            concurrency,
            prefetch,
        )
        self.fleets.append(fleet)
        return fleet

    def app(self, **options: Any) -> Any:
        app = make_app(self.ctx.url_dsn, self.schema, self.run_id, options, 1)
        self.apps.append(app)
        return app

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.ctx.dsn, autocommit=True)

    def wait_ready(self, conn: psycopg.Connection, n: int, timeout: float = 60) -> None:
        from psycopg import sql

        table = ledger.tables(self.run_id)["event"]
        procs.wait_for(
            lambda: (
                ledger.count(
                    conn, sql.SQL("SELECT count(*) FROM {} WHERE kind = 'ready'").format(table)
                )
                >= n
            ),
            timeout,
            f"{n} workers ready",
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started
