"""failover: the primary crashes and its streaming standby is promoted under a live
Celery worker and a publisher.

A throwaway primary and standby (``tests/clusters.py``) hold the broker; the ledger stays
on the run's database (``--dsn``), which the failover does not touch. A publisher process
sends tasks one by one at a steady rate (``send_task(retry=True)`` plus an outer retry)
and writes down each id and time once its publish returned; one ``celery worker -P
prefork -c 2`` (``acks_late``) runs them. When a third has been published, the standby
is cut off from the primary for ``CHAOS_FAILOVER_LAG`` seconds (default 1; 0: not at
all), standing in for replication lag, which on one machine is too small to lose
anything; then the primary is stopped with ``pg_ctl -m immediate`` and the standby
promoted. Both use a broker URL that names both servers:

* ``libpq`` (default): ``pgqueue+postgresql://postgres@/postgres?host=127.0.0.1,127.0.0.1
  &port=P1,P2&target_session_attrs=read-write``; libpq tries the hosts in turn and takes
  the first that accepts writes.
* ``kombu`` (``CHAOS_FAILOVER_URL=kombu``): Kombu's failover list
  ``pgqueue://postgres@127.0.0.1:P1/postgres;pgqueue://postgres@127.0.0.1:P2/postgres``;
  Kombu moves to the next URL after a connection error.

It runs twice: with synchronous replication (a commit returns once the standby has
flushed it: 0 lost expected; publishes wait while the standby is cut off) and
asynchronous (publishes go on returning while the standby is cut off, and those never
reach it: whatever is lost is listed with its publish time before the crash).

Measured: the time from the promotion to the first and the 20th task started after it
(the worker holds up to 8 prefetched tasks and 2 running, so the 20th was certainly
claimed from the new primary), the publisher's gap, the worker's reconnect lines, and
whether the worker had to be restarted (if no task starts within ``RESUME_SECONDS`` of
the promotion it is restarted, as an operator would: a FAIL).

``celery -A benchmarks.chaos.failover worker`` also loads this module: ``app`` is built
from the environment as in :mod:`benchmarks.chaos.app`, with ``CHAOS_BROKER_URL``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

import kombu_pgqueue

from . import ledger, procs
from .app import make_app
from .context import Context, Result, Run

# the cluster helper lives with the tests, which use it most; the chaos suite borrows it
sys.path.insert(0, str(procs.ROOT / "tests"))
from clusters import Cluster  # noqa: E402

#: publishes per second
RATE = 100.0
#: seconds after the promotion within which a task must start, or the worker is restarted
RESUME_SECONDS = 30.0
#: seconds the standby is cut off from the primary before the crash (CHAOS_FAILOVER_LAG):
#: replication lag, which on one machine is otherwise too small to lose anything
LAG_SECONDS = float(os.environ.get("CHAOS_FAILOVER_LAG", "1.0"))
#: the worker's transport options: held messages come back 10 s after a lost lease
OPTIONS = {"visibility_timeout": 10, "polling_interval": 2}
URL_FORMS = ("libpq", "kombu")


def broker_url(form: str, primary: Cluster, standby: Cluster) -> str:
    if form == "kombu":
        return ";".join(
            f"pgqueue://postgres@127.0.0.1:{c.port}/postgres" for c in (primary, standby)
        )
    return (
        "pgqueue+postgresql://postgres@/postgres?host=127.0.0.1,127.0.0.1"
        f"&port={primary.port},{standby.port}&target_session_attrs=read-write"
    )


# -- the processes ---------------------------------------------------------------------


def _app(dsn: str, schema: str, run_id: str, url: str, prefetch: int) -> Any:
    app = make_app(dsn, schema, run_id, OPTIONS, prefetch)
    app.conf.broker_url = url  # the broker fails over; the ledger (dsn) stays put
    return app


def __getattr__(name: str) -> Any:
    # built on first use: `celery -A benchmarks.chaos.failover` looks up `app`
    if name == "app":
        env = os.environ
        globals()["app"] = built = _app(
            env["CHAOS_DSN"],
            env["CHAOS_SCHEMA"],
            env["CHAOS_RUN"],
            env["CHAOS_BROKER_URL"],
            int(env.get("CHAOS_PREFETCH", "4")),
        )
        return built
    raise AttributeError(name)


def _spawn_worker(run: Run, url: str, name: str) -> procs.Worker:
    env = procs.worker_env(
        dsn=run.ctx.dsn, schema=run.schema, run=run.run_id, broker_url=url, prefetch=4
    )
    log_path = run.ctx.logs / f"{run.run_id}-{name}.log"
    return procs.start_worker("benchmarks.chaos.failover", name, log_path, env, concurrency=2)


def _stop(worker: procs.Worker) -> None:
    if worker.alive():
        worker.proc.send_signal(signal.SIGTERM)
        try:
            worker.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    worker.kill_group()


def _publisher(
    dsn: str, schema: str, run_id: str, url: str, count: int, rate: float, ids_path: str
) -> None:
    """Send ``count`` tasks at ``rate``/s, retrying; write ``id<TAB>time`` per success."""
    with open(ids_path + ".log", "ab") as log:  # psycopg's pool warnings too
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    app = _app(dsn, schema, run_id, url, 1)
    rng = random.Random(11)
    policy = {"max_retries": 60, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2}
    began = time.monotonic()
    with open(ids_path, "w") as out:
        for i in range(count):
            procs.pause(max(0.0, began + i / rate - time.monotonic()))
            task_id = str(uuid.uuid4())
            # mostly short tasks, some long enough to be running when the primary dies
            seconds = rng.uniform(0.0, 0.01) if rng.random() < 0.95 else rng.uniform(0.2, 1.0)
            for attempt in range(240):
                try:
                    app.send_task(
                        "chaos.work", (seconds,), task_id=task_id, retry=True, retry_policy=policy
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - retried, then given up on
                    if attempt == 0:
                        print(
                            f"    publisher: publish failed ({type(exc).__name__}: {exc}); "
                            "retrying",
                            flush=True,
                        )
                    procs.pause(0.5)
            else:
                continue  # never believed published: not written down
            out.write(f"{task_id}\t{time.time()}\n")
            out.flush()
    app.close()


# -- one run -----------------------------------------------------------------------------


def _started_after(conn: psycopg.Connection, run_id: str, at: datetime.datetime, k: int) -> Any:
    row = conn.execute(
        sql.SQL(
            "SELECT started_at FROM {} WHERE started_at > %s ORDER BY started_at OFFSET %s LIMIT 1"
        ).format(ledger.tables(run_id)["exec"]),
        (at, k - 1),
    ).fetchone()
    return row[0] if row else None


def _broker_count(cluster: Cluster, schema: str, table: str) -> int:
    with cluster.connect() as conn:
        return ledger.count(
            conn, sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))
        )


def _replication_lag(primary: Cluster) -> str:
    with primary.connect() as conn:
        row = conn.execute(
            "SELECT pg_current_wal_lsn() - flush_lsn, pg_current_wal_lsn() - replay_lsn "
            "FROM pg_stat_replication"
        ).fetchone()
    return f"{row[0]} / {row[1]} bytes" if row else "no standby streaming"


def _duplicates(
    conn: psycopg.Connection, run_id: str, crashed: datetime.datetime
) -> list[tuple[str, list[float]]]:
    """Tasks that ran more than once, with their starts in seconds from the crash."""
    rows = conn.execute(
        sql.SQL(
            "SELECT task_id, array_agg(started_at ORDER BY started_at) FROM {} "
            "GROUP BY task_id HAVING count(*) > 1 ORDER BY min(started_at)"
        ).format(ledger.tables(run_id)["exec"])
    ).fetchall()
    return [
        (task_id, [round((at - crashed).total_seconds(), 2) for at in starts])
        for task_id, starts in rows
    ]


def _log_lines(worker: procs.Worker, *marks: str) -> list[str]:
    return [line for line in worker.log_tail(10**7).splitlines() if any(m in line for m in marks)]


def _one(
    ctx: Context, n: int, synchronous: bool, form: str
) -> tuple[bool, list[tuple[str, Any]], list[str]]:
    mode = "sync" if synchronous else "async"
    rows: list[tuple[str, Any]] = []
    notes: list[str] = []
    with ctx.run(f"failover-{mode}") as run, run.connect() as conn, Cluster.primary() as primary:
        standby = primary.standby(synchronous=synchronous)
        kombu_pgqueue.migrate(primary.dsn, run.schema)
        url = broker_url(form, primary, standby)
        print(f"    {mode}: primary :{primary.port}, standby :{standby.port}; broker {url}")
        workers = [_spawn_worker(run, url, "w1")]
        publisher: Any = None
        try:
            run.wait_ready(conn, 1)
            ids_path = ctx.logs / f"{run.run_id}-publisher.ids"
            publisher = multiprocessing.get_context("spawn").Process(
                target=_publisher,
                args=(ctx.dsn, run.schema, run.run_id, url, n, RATE, str(ids_path)),
            )
            publisher.start()
            procs.wait_for(
                lambda: ids_path.exists() and len(ids_path.read_text().splitlines()) >= n // 3,
                n / RATE + 60,
                "a third of the tasks to be published",
                every=0.1,
            )
            lag = _replication_lag(primary)
            if LAG_SECONDS:
                standby.stop_streaming()
            cut_at = len(ids_path.read_text().splitlines())
            procs.pause(LAG_SECONDS)
            during_cut = len(ids_path.read_text().splitlines()) - cut_at
            crashed = datetime.datetime.now(datetime.timezone.utc)
            primary.stop("immediate")
            stopped = datetime.datetime.now(datetime.timezone.utc)
            ledger.record_event(conn, run.run_id, "dbrestart", "failover", at=crashed)
            standby.promote()
            promoted = datetime.datetime.now(datetime.timezone.utc)
            # a message held at the crash and run again from the new primary has its
            # first run before the promotion and its second after it
            ledger.record_event(conn, run.run_id, "dbrestart", "promotion", at=promoted)
            print(
                f"    promoted the standby "
                f"{(promoted - crashed).total_seconds():.1f} s after the crash"
            )

            restarted = False
            try:
                first = procs.wait_for(
                    lambda: _started_after(conn, run.run_id, promoted, 1),
                    RESUME_SECONDS,
                    "a task to start after the promotion",
                    every=0.05,
                )
            except TimeoutError:
                restarted = True
                notes.append(
                    f"FAIL: no task started within {RESUME_SECONDS:.0f} s of the promotion; "
                    "the worker was restarted. Its log's tail:\n" + workers[0].log_tail(1500)
                )
                _stop(workers[0])
                workers.append(_spawn_worker(run, url, "w2"))
                first = procs.wait_for(
                    lambda: _started_after(conn, run.run_id, promoted, 1),
                    RESUME_SECONDS,
                    "a task to start after the worker's restart",
                    every=0.05,
                )
            twentieth = procs.wait_for(
                lambda: _started_after(conn, run.run_id, promoted, 20),
                RESUME_SECONDS,
                "20 tasks to start after the promotion",
                every=0.05,
            )
            publisher.join(timeout=n / RATE + 300)
            published = [
                (task_id, float(at))
                for task_id, at in (
                    line.split("\t") for line in ids_path.read_text().splitlines() if line
                )
            ]
            ledger.record_published(conn, run.run_id, [task_id for task_id, _ in published])
            try:
                drained = procs.wait_for(
                    lambda: _broker_count(standby, run.schema, "message_store") == 0,
                    OPTIONS["visibility_timeout"] * 3 + 60,
                    "the queue to drain on the new primary",
                    every=0.5,
                )
            except TimeoutError:
                drained = False
        finally:
            if publisher is not None and publisher.is_alive():
                publisher.kill()
            # before the stop ends them; one replaced by the restart is counted there
            broken = [w.name for w in workers[-1:] if w.broken()]
            for worker in workers:
                _stop(worker)
        fig = ledger.analyse(conn, run.run_id, run.schema)
        dead = _broker_count(standby, run.schema, "dead_letter")
        gap = max(
            (b - a for (_, a), (_, b) in zip(published, published[1:]) if b > crashed.timestamp()),
            default=0.0,
        )
        at = dict(published)
        reconnects = _log_lines(workers[0], "re-establish", "Cannot connect")
        restarts = _log_lines(workers[0], "Frequent restarts detected")
        resumed = min((t for _, t in published if t > promoted.timestamp()), default=None)
        passed = (
            not restarted
            and not broken
            and fig.overlapping == 0
            and (fig.lost == 0 or not synchronous)
            and bool(drained)
        )
        rows += [(f"{mode}: {key}", value) for key, value in fig.rows()]
        rows += [
            (f"{mode}: dead letters on the new primary", dead),
            (f"{mode}: WAL the standby had not flushed / replayed before the cut-off", lag),
            (
                f"{mode}: publishes that returned while the standby was cut off "
                f"({LAG_SECONDS:.1f} s before the crash)",
                during_cut,
            ),
            (f"{mode}: crash to promoted", f"{(promoted - crashed).total_seconds():.1f} s"),
            (
                f"{mode}: first / 20th task start after the promotion",
                f"{(first - promoted).total_seconds():.1f} s / "
                f"{(twentieth - promoted).total_seconds():.1f} s",
            ),
            (
                f"{mode}: publisher: first publish returned after the promotion / longest "
                "pause between two publishes",
                ("never" if resumed is None else f"{resumed - promoted.timestamp():.1f} s")
                + f" / {gap:.1f} s",
            ),
            (f"{mode}: worker log: 'lost' + 'Cannot connect' lines", len(reconnects)),
            (f"{mode}: worker log: 'Frequent restarts detected' (CRITICAL)", len(restarts)),
            (f"{mode}: worker restart needed", "YES (FAIL)" if restarted else "no"),
            (f"{mode}: verdict", "PASS" if passed else "FAIL"),
        ]
        if fig.lost_ids:
            times = sorted(at[i] for i in fig.lost_ids if i in at)
            notes.append(
                f"{mode}: {fig.lost} lost, published from "
                f"{(crashed.timestamp() - times[0]) * 1000:.0f} ms before the stop command "
                f"to {(times[-1] - crashed.timestamp()) * 1000:.0f} ms after it (it took "
                f"{(stopped - crashed).total_seconds() * 1000:.0f} ms): their commits "
                "returned on the primary and never reached the standby"
                + ("" if not synchronous else " (synchronous replication should not lose any)")
            )
        if broken:
            notes.append(f"{mode}: worker(s) exited or logged 'Unrecoverable error': {broken}")
        for task_id, starts in _duplicates(conn, run.run_id, crashed)[:5]:
            notes.append(f"{mode}: ran twice: {task_id}, started at {starts} s from the crash")
        if reconnects:
            notes.append(
                f"{mode}: worker reconnect lines (first 3 of {len(reconnects)}):\n      "
                + "\n      ".join(line[:300] for line in reconnects[:3])
            )
        return passed, rows, notes


def failover(ctx: Context) -> Result:
    n = ctx.tasks or (1000 if ctx.quick else 3000)
    form = os.environ.get("CHAOS_FAILOVER_URL", "libpq")
    if form not in URL_FORMS:
        raise ValueError(f"CHAOS_FAILOVER_URL must be one of {', '.join(URL_FORMS)}, got {form!r}")
    result = Result("failover", True)
    result.measures.append(("broker URL form (CHAOS_FAILOVER_URL)", form))
    result.measures.append(("tasks per run, publish rate", f"{n}, {RATE:.0f}/s"))
    result.measures.append(("standby cut off before the crash (CHAOS_FAILOVER_LAG)", LAG_SECONDS))
    for synchronous in (True, False):
        passed, rows, notes = _one(ctx, n, synchronous, form)
        result.passed = result.passed and passed
        result.measures += rows
        result.notes += notes
    result.measures.append(("transport options", json.dumps(OPTIONS)))
    return result
