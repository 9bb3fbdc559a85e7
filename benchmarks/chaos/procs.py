"""Processes and the database server: Celery workers to start and kill, schemas, restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil
import psycopg
from psycopg import sql

import kombu_pgqueue

from . import ledger

ROOT = Path(__file__).resolve().parents[2]
PG_VERSION, PG_CLUSTER = "15", "main"


def pause(seconds: float) -> None:
    threading.Event().wait(seconds)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        pause(every)


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def children(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def broken(self) -> bool:
        """Exited by itself, or logged Celery's "Unrecoverable error" (it may hang on)."""
        if not self.alive():
            return True
        try:
            return "Unrecoverable error" in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def worker_env(**variables: object) -> dict[str, str]:
    """The environment of a chaos worker: this process's, with the checkout first on
    ``PYTHONPATH`` and each of ``variables`` as ``CHAOS_<NAME>`` (``run=...``: ``CHAOS_RUN``)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.update({f"CHAOS_{key.upper()}": str(value) for key, value in variables.items()})
    return env


def start_worker(
    app: str, name: str, log_path: Path, env: Mapping[str, str], concurrency: int
) -> Worker:
    """``celery -A APP worker -n NAME@chaos``: prefork, ``concurrency`` children, queue
    ``celery``, from the checkout, its output in ``log_path``, in a process group of its
    own (:meth:`Worker.kill_group` ends its pool children too)."""
    command = [sys.executable, "-m", "celery", "-A", app, "worker", "-n", f"{name}@chaos"]
    command += ["-P", "prefork", "-c", str(concurrency), "-Q", "celery", "-l", "warning"]
    command += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(f"{name}@chaos", proc, log_path)


@dataclass
class Fleet:
    """The workers of one scenario; every process it started is gone after :meth:`stop`."""

    dsn: str
    schema: str
    run: str
    logs: Path
    options: dict[str, Any]
    concurrency: int = 3
    prefetch: int = 4
    workers: list[Worker] = field(default_factory=list)
    started: int = 0
    #: the module its workers run (``celery -A``); a subclass's own app
    app: ClassVar[str] = "benchmarks.chaos.app"
    #: workers that exited by themselves and were started again by :meth:`supervise`
    crashed: list[Worker] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def supervise(self, every: float = 0.5) -> None:
        """Start a new worker for each that exits by itself, as systemd would."""

        def loop() -> None:
            while not self._stopping.wait(every):
                for worker in list(self.workers):
                    if worker in self.crashed or getattr(worker, "reaped", False):
                        continue
                    if not worker.broken():
                        continue
                    if self._stopping.is_set():
                        return
                    self.crashed.append(worker)
                    worker.kill_group()
                    try:
                        with psycopg.connect(self.dsn, autocommit=True) as conn:
                            ledger.record_event(
                                conn, self.run, "crash", worker.name, worker.proc.pid
                            )
                    except psycopg.Error:
                        pass
                    self.spawn()

        threading.Thread(target=loop, name="supervisor", daemon=True).start()

    def spawn(self) -> Worker:
        self.started += 1
        name = f"w{self.started}"
        env = worker_env(
            dsn=self.dsn,
            schema=self.schema,
            run=self.run,
            options=json.dumps(self.options),
            prefetch=self.prefetch,
        )
        log_path = self.logs / f"{self.run}-{name}.log"
        worker = start_worker(self.app, name, log_path, env, self.concurrency)
        self.workers.append(worker)
        return worker

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.alive()]

    def stop(self, timeout: float = 20) -> None:
        self._stopping.set()
        for worker in self.workers:
            if worker.alive():
                worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            worker.kill_group()  # and any orphaned pool children


def create_schema(dsn: str, schema: str) -> None:
    kombu_pgqueue.migrate(dsn, schema)


def pg_running() -> bool:
    out = subprocess.run(
        ["pg_ctlcluster", PG_VERSION, PG_CLUSTER, "status"], capture_output=True, text=True
    )
    return out.returncode == 0


def pg_ensure_running() -> None:
    """Start the system server if it is down (it is shared: never leave it stopped)."""
    if not pg_running():
        subprocess.run(
            ["pg_ctlcluster", "--skip-systemctl-redirect", PG_VERSION, PG_CLUSTER, "start"],
            capture_output=True,
        )


def table_stats(
    conn: psycopg.Connection, schema: str, table: str = "message_store"
) -> dict[str, Any]:
    """n_dead_tup, n_live_tup and sizes of ``schema.table`` and each of its indexes; for a
    partitioned table (message_store's generations), summed over its partitions, and
    each index by the name of the partitioned one."""
    row = conn.execute(
        """
        SELECT sum(n_live_tup), sum(n_dead_tup), sum(pg_total_relation_size(relid)),
               sum(pg_relation_size(relid))
        FROM pg_stat_user_tables
        WHERE relid IN (
            SELECT p.relid FROM pg_partition_tree(format('%%I.%%I', %(s)s::text, %(t)s::text))
                AS p WHERE p.isleaf
        )
        """,
        {"s": schema, "t": table},
    ).fetchone()
    assert row is not None
    found = conn.execute(
        """
        SELECT coalesce(parent.relname, s.indexrelname), pg_relation_size(s.indexrelid)
        FROM pg_stat_user_indexes AS s
        LEFT JOIN pg_class AS parent ON parent.oid = pg_partition_root(s.indexrelid)
        WHERE s.relid IN (
            SELECT p.relid FROM pg_partition_tree(format('%%I.%%I', %(s)s::text, %(t)s::text))
                AS p WHERE p.isleaf
        )
        """,
        {"s": schema, "t": table},
    ).fetchall()
    indexes: dict[str, int] = {}
    for name, size in found:
        indexes[name] = indexes.get(name, 0) + int(size)
    return {
        "n_live_tup": int(row[0] or 0),
        "n_dead_tup": int(row[1] or 0),
        "total_bytes": int(row[2] or 0),
        "heap_bytes": int(row[3] or 0),
        "indexes": dict(sorted(indexes.items())),
    }


def vacuum_ticker(
    dsn: str, schema: str, interval: float, stop: threading.Event
) -> threading.Thread:
    """VACUUM ``schema.message_store`` every ``interval`` s (autovacuum is off here)."""

    def loop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.wait(interval):
                conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(schema, "message_store")))

    thread = threading.Thread(target=loop, name="vacuum", daemon=True)
    thread.start()
    return thread
