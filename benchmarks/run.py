#!/usr/bin/env python
"""Benchmark kombu_pgqueue against Redis, RabbitMQ and Kombu's SQLAlchemy transport.

    python benchmarks/run.py [--quick] [--runs N] [--only NAME,...]
                             [--brokers pgqueue,redis,rabbitmq,sqla] [--markdown FILE]

Every broker runs the same code, on the same machine, with the same Celery
settings (``bench_app.COMMON_SETTINGS``), in one invocation; runs are interleaved
(run 1 of every broker, then run 2, ...) so drift hits all alike. Each figure is
the median of ``--runs`` runs with its min-max range. A broker that cannot be
reached is reported as absent. See README.md for what each figure measures.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (HERE, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)

import psycopg  # noqa: E402
from bench_app import COMMON_SETTINGS, make_app  # noqa: E402
from kombu import Connection, Consumer, Exchange, Producer, Queue  # noqa: E402
from pgproxy import CountingProxy  # noqa: E402

import kombu_pgqueue  # noqa: E402,F401 - registers pgqueue://

PG_DSN = os.environ.get("BENCH_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test")
PG_HOSTPORT = ("127.0.0.1", 5432)
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

STEP_WATCHDOG = 300.0  # seconds

WORKER_FLAGS = ["--without-mingle", "--without-gossip", "-l", "WARNING"]

SIZES = {
    # caps are in seconds: a slow broker publishes what fits in the cap (noted in the output)
    "full": dict(
        kombu_n=5000,
        kombu_cap=10.0,
        consume_cap=20.0,
        celery_n=5000,
        publish_cap=8.0,
        drain_timeout=300.0,
        latency_n=200,
        latency_min=15,
        latency_cap=15.0,
        idle_settle=3.0,
        idle_window=20.0,
        deep_n=10_000_000,
        claim_reps=200,
        churn_n=50_000,
        bulk_n=1_000_000,
        bulk_tasks=200_000,
        eta_n=100_000,
        eta_settle_cap=45.0,
    ),
    "quick": dict(
        kombu_n=1000,
        kombu_cap=4.0,
        consume_cap=8.0,
        celery_n=1000,
        publish_cap=5.0,
        drain_timeout=120.0,
        latency_n=50,
        latency_min=8,
        latency_cap=5.0,
        idle_settle=2.0,
        idle_window=6.0,
        deep_n=300_000,
        claim_reps=30,
        churn_n=20_000,
        bulk_n=100_000,
        bulk_tasks=50_000,
        eta_n=5_000,
        eta_settle_cap=10.0,
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------
# brokers


@dataclass
class Broker:
    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    #: the URL for a worker that must go through the counting proxy (PostgreSQL only)
    url_via: Callable[[int], str] | None = None
    available: bool = False
    why_absent: str = ""
    version: str = ""


def make_brokers(prefix: str) -> dict[str, Broker]:
    return {
        "pgqueue": Broker(
            "pgqueue",
            "pgqueue://postgres@127.0.0.1/test",
            {"schema": prefix},
            url_via=lambda port: f"pgqueue://postgres@127.0.0.1:{port}/test",
        ),
        # the opt-in trade (transport option synchronous_commit=off): a publish returns
        # before its WAL flush, as Redis without AOF and RabbitMQ without confirms do
        "pgqueue_async": Broker(
            "pgqueue_async",
            "pgqueue://postgres@127.0.0.1/test",
            {"schema": f"{prefix}_async", "synchronous_commit": "off"},
            url_via=lambda port: f"pgqueue://postgres@127.0.0.1:{port}/test",
        ),
        "redis": Broker("redis", REDIS_URL),
        "rabbitmq": Broker("rabbitmq", AMQP_URL),
        # RabbitMQ with publisher confirms: a publish returns once the broker has the
        # message, as a pgqueue publish returns once it is committed (durable queues)
        "rabbitmq_confirm": Broker("rabbitmq_confirm", AMQP_URL, {"confirm_publish": True}),
        "sqla": Broker(
            "sqla",
            "sqla+postgresql+psycopg://postgres@127.0.0.1/test",
            # its own schema: Kombu names the tables' indexes without the table name,
            # so two kombu_message tables cannot share a schema
            {"connect_args": {"options": f"-c search_path={prefix}_sqla"}},
            url_via=lambda port: f"sqla+postgresql+psycopg://postgres@127.0.0.1:{port}/test",
        ),
    }


def probe(broker: Broker) -> None:
    try:
        if broker.name == "sqla":
            with psycopg.connect(PG_DSN, autocommit=True, connect_timeout=3) as conn:
                schema = broker.options["connect_args"]["options"].rpartition("=")[2]
                conn.execute(
                    psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                        psycopg.sql.Identifier(schema)
                    )
                )
        with Connection(broker.url, transport_options=broker.options, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
            ch = conn.channel()
            q = Queue(f"probe_{uuid.uuid4().hex[:6]}", routing_key="probe")
            q(ch).declare()
            q(ch).delete()
            if broker.name == "rabbitmq":
                props = conn.connection.server_properties
                broker.version = f"RabbitMQ {props.get('version', b'?')}"
        broker.available = True
    except Exception as exc:  # noqa: BLE001 - anything means "not reachable"
        broker.available = False
        broker.why_absent = f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------
# workers and the sink


class Sink:
    """Reads what the worker's signal handlers append (see bench_app)."""

    def __init__(self, path: str) -> None:
        self.path = path
        open(path, "w").close()
        self._offset = 0
        self._partial = ""
        self.ready = False
        self.done: list[tuple[float, float, str]] = []
        self.latency: list[tuple[float, float]] = []

    def read(self) -> None:
        with open(self.path) as f:
            f.seek(self._offset)
            data = f.read()
            self._offset = f.tell()
        if not data:
            return
        data = self._partial + data
        lines = data.split("\n")
        self._partial = lines.pop()
        for line in lines:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "ready":
                self.ready = True
            elif parts[0] == "e":
                self.done.append((float(parts[1]), float(parts[2]), parts[3]))
            elif parts[0] == "l":
                self.latency.append((float(parts[1]), float(parts[2])))


class Worker:
    """A ``celery worker`` subprocess in its own process group."""

    all: list[Worker] = []

    def __init__(
        self,
        ctx: Ctx,
        broker: Broker,
        queue: str,
        pool: str,
        concurrency: int,
        url: str | None = None,
        tag: str = "w",
    ) -> None:
        self.sink = Sink(os.path.join(ctx.tmp, f"sink-{queue}-{tag}.txt"))
        self.logfile = os.path.join(ctx.tmp, f"worker-{queue}-{tag}.log")
        env = dict(os.environ)
        env.update(
            BENCH_BROKER_URL=url or broker.url,
            BENCH_TRANSPORT_OPTIONS=json.dumps(broker.options),
            BENCH_QUEUE=queue,
            BENCH_SINK=self.sink.path,
            PYTHONPATH=os.pathsep.join(filter(None, [HERE, ROOT, env.get("PYTHONPATH")])),
        )
        self.cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench_app",
            "worker",
            "--pool",
            pool,
            "-c",
            str(concurrency),
            *WORKER_FLAGS,
            "-n",
            f"{queue}-{tag}@%h",
        ]
        self._log = open(self.logfile, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=HERE,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started = time.time()
        self.killed = False
        Worker.all.append(self)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sink.read()
            if self.sink.ready:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.logfile, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """The worker's processes (its process group)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getpgid(int(entry)) == self.proc.pid:
                        found.append(int(entry))
                except OSError:
                    pass
        return found

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024.0

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.killed = self.proc.poll() is None
        # the children too, even if the main process is already gone
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        if self in Worker.all:
            Worker.all.remove(self)


# ---------------------------------------------------------------------------------
# the run context


@dataclass
class Ctx:
    sizes: dict[str, Any]
    runs: int
    prefix: str
    tmp: str
    brokers: dict[str, Broker]
    queues: dict[str, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    code_at_start: str = ""

    def queue(self, broker: Broker, name: str) -> str:
        full = f"{self.prefix}_{name}"
        self.queues.setdefault(broker.name, set()).add(full)
        return full

    def problem(self, broker: str, figure: str, text: str) -> None:
        msg = f"[{broker}] {figure}: {text}"
        self.problems.append(msg)
        log("PROBLEM " + msg.splitlines()[0])


def kombu_queue(name: str) -> Queue:
    # the queue Celery declares for task_default_queue=name
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def declare(broker: Broker, name: str) -> None:
    with Connection(broker.url, transport_options=broker.options) as conn:
        kombu_queue(name)(conn.channel()).declare()


def delete_queue(broker: Broker, name: str) -> None:
    try:
        with Connection(broker.url, transport_options=broker.options) as conn:
            ch = conn.channel()
            q = kombu_queue(name)(ch)
            try:
                q.purge()
            except Exception:  # noqa: BLE001,S110
                pass
            q.delete()
    except Exception as exc:  # noqa: BLE001
        log(f"warning: could not delete {broker.name} queue {name}: {exc!r}")


# ---------------------------------------------------------------------------------
# figures

# key -> (label, unit, better) ; better is "higher" or "lower"
FIGURES: dict[str, tuple[str, str, str]] = {
    "kombu_publish": ("Kombu publish, 1 process", "msg/s", "higher"),
    "kombu_consume": ("Kombu consume+ack, prefetch 100", "msg/s", "higher"),
    "celery_publish": ("Celery apply_async, 1 process", "tasks/s", "higher"),
    "drain_prefork": ("Celery drain, prefork -c 2", "tasks/s", "higher"),
    "drain_threads": ("Celery drain, threads -c 8", "tasks/s", "higher"),
    "latency_p50": ("Latency apply_async->start p50", "ms", "lower"),
    "latency_p95": ("Latency apply_async->start p95", "ms", "lower"),
    "latency_p99": ("Latency apply_async->start p99", "ms", "lower"),
    "idle_stmts": ("Idle worker: statements sent", "stmt/s", "lower"),
    "idle_trips": ("Idle worker: round trips", "trips/s", "lower"),
    "idle_conns": ("Idle worker: server connections held", "conns", "lower"),
    "claim1_shallow": ("claim(1)+ack, 10k backlog", "ms", "lower"),
    "claim1_deep": ("claim(1)+ack, deep backlog", "ms", "lower"),
    "claim100_shallow": ("claim(100)+ack_many, 10k backlog", "ms", "lower"),
    "claim100_deep": ("claim(100)+ack_many, deep backlog", "ms", "lower"),
    "drain_shallow": ("drain by claim(100)+ack_many, 10k backlog", "msg/s", "higher"),
    "drain_deep": ("drain by claim(100)+ack_many, deep backlog", "msg/s", "higher"),
    "claim1_churned": ("claim(1)+ack after churn_n acks, no vacuum", "ms", "lower"),
    "claim1_vacuumed": ("claim(1)+ack, same, after VACUUM", "ms", "lower"),
    "bulk_publish_rows": (
        "Store.publish_rows, batches of 10,000, dedup keys",
        "msg/s",
        "higher",
    ),
    "bulk_send_many": ("celery_pgqueue send_many, no-op signatures", "tasks/s", "higher"),
    "bulk_copy": ("COPY into the message table", "msg/s", "higher"),
    "rss_empty": ("Worker RSS (prefork -c 2), empty queue", "MB", "lower"),
    "rss_eta": ("Worker RSS with ETA tasks due tomorrow", "MB", "lower"),
    "eta_held": ("ETA tasks held in worker memory", "tasks", "lower"),
}

SMALL_BODY = {"id": 0, "payload": "x" * 64}


def bench_kombu(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    n, cap = ctx.sizes["kombu_n"], ctx.sizes["kombu_cap"]
    name = ctx.queue(broker, f"k{run}")
    out: dict[str, float] = {}
    with Connection(broker.url, transport_options=broker.options) as conn:
        ch = conn.channel()
        queue = Queue(name, routing_key=name)  # default exchange: straight to the queue
        bound = queue(ch)
        bound.declare()
        bound.purge()
        producer = Producer(ch, serializer="json")
        for _ in range(100):  # warm-up: connection, pooled connections, prepared statements
            producer.publish(SMALL_BODY, routing_key=name)
        bound.purge()
        published = 0
        t0 = time.perf_counter()
        for i in range(n):
            producer.publish({"id": i, "payload": SMALL_BODY["payload"]}, routing_key=name)
            published += 1
            if i % 100 == 99 and time.perf_counter() - t0 > cap:
                break
        out["kombu_publish"] = published / (time.perf_counter() - t0)
        if published < n:
            ctx.notes.append(
                f"{broker.name}: kombu publish stopped at the {cap:.0f}s cap "
                f"after {published} of {n} messages"
            )
        got = 0

        def on_message(body: Any, message: Any) -> None:
            nonlocal got
            message.ack()
            got += 1

        consumer = Consumer(
            ch, [queue], callbacks=[on_message], prefetch_count=100, accept=["json"]
        )
        deadline = time.monotonic() + ctx.sizes["consume_cap"]
        t0 = time.perf_counter()
        with consumer:
            while got < published and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=2)
                except TimeoutError:
                    pass
                except OSError as exc:
                    if "timed out" not in str(exc):
                        raise
        elapsed = time.perf_counter() - t0
        if got:
            out["kombu_consume"] = got / elapsed
        if got < published:
            ctx.notes.append(
                f"{broker.name}: kombu consume stopped at the {ctx.sizes['consume_cap']:.0f}s "
                f"cap after {got} of {published} messages"
            )
        try:
            left = bound.queue_declare(passive=True).message_count
        except Exception:  # noqa: BLE001 - Redis forgets an empty queue
            left = 0
        if left != published - got:
            ctx.problem(
                broker.name,
                "kombu_consume",
                f"{left} messages left after consuming {got} of {published}",
            )
        if broker.name.startswith("pgqueue"):
            # every acked message must be gone from the table, not merely invisible
            time.sleep(0.2)
            with psycopg.connect(PG_DSN, autocommit=True) as pg:
                rows = pg.execute(
                    psycopg.sql.SQL(
                        "SELECT count(*) FROM {}.message WHERE queue = %s AND lease IS NOT NULL"
                    ).format(psycopg.sql.Identifier(broker.options["schema"])),
                    (name,),
                ).fetchone()[0]
            if rows:
                ctx.problem(
                    broker.name,
                    "kombu_consume",
                    f"{rows} delivered+acked messages are still in the table",
                )
        bound.delete()
    return out


def publish_backlog(ctx: Ctx, broker: Broker, name: str, n: int) -> tuple[int, float]:
    """apply_async up to n no-op tasks from this process (time-capped); return (count, tasks/s)."""
    cap = ctx.sizes["publish_cap"]
    declare(broker, name)
    app = make_app(broker.url, broker.options, name)
    try:
        noop = app.tasks["bench.noop"]
        for _ in range(20):  # warm-up: connection, producer pool, declarations, prepares
            noop.apply_async()
        sent = 20
        t0 = time.perf_counter()
        while sent < n:
            noop.apply_async()
            sent += 1
            if sent % 100 == 0 and time.perf_counter() - t0 > cap:
                break
        rate = (sent - 20) / (time.perf_counter() - t0)
        if sent < n:
            ctx.notes.append(
                f"{broker.name}: Celery backlog publishing stopped at the {cap:.0f}s cap "
                f"({sent} of {n} tasks); drain figures use that backlog"
            )
        return sent, rate
    finally:
        app.close()


def drain(ctx: Ctx, worker: Worker, broker: Broker, n: int, figure: str) -> float | None:
    """Wait until the worker has run n tasks; return tasks/s first start -> last end."""
    deadline = time.monotonic() + ctx.sizes["drain_timeout"]
    sink = worker.sink
    while time.monotonic() < deadline:
        sink.read()
        if len(sink.done) >= n:
            break
        if worker.proc.poll() is not None:
            ctx.problem(broker.name, figure, f"worker died:\n{worker.log_tail()}")
            return None
        time.sleep(0.05)
    time.sleep(0.3)  # catch duplicates that arrive late
    sink.read()
    ids = [d[2] for d in sink.done]
    unique = len(set(ids))
    if unique < n:
        ctx.problem(
            broker.name,
            figure,
            f"only {unique} of {n} tasks ran within {ctx.sizes['drain_timeout']:.0f}s "
            f"(cmd: {' '.join(worker.cmd)}; log tail:\n{worker.log_tail(15)})",
        )
        return None
    if len(ids) > unique:
        ctx.problem(broker.name, figure, f"{len(ids) - unique} tasks ran twice")
    first = min(d[0] for d in sink.done)
    last = max(d[1] for d in sink.done)
    return n / (last - first)


def measure_latency(
    ctx: Ctx, worker: Worker, broker: Broker, name: str, run: int
) -> dict[str, float]:
    """Sequential apply_async -> task start on an idle worker consuming queue name."""
    n, cap = ctx.sizes["latency_n"], ctx.sizes["latency_cap"]
    app = make_app(broker.url, broker.options, name)
    out: dict[str, float] = {}
    try:
        worker.wait_ready()
        time.sleep(1.0)
        task = app.tasks["bench.latency"]
        sink = worker.sink
        samples: list[float] = []
        lost = 0
        warmup = 5
        t_start = time.monotonic()
        for i in range(warmup + n):
            have = len(sink.latency)
            task.apply_async((time.time(),))
            wait_until = time.monotonic() + 15.0
            while len(sink.latency) == have and time.monotonic() < wait_until:
                time.sleep(0.001)
                sink.read()
            if len(sink.latency) == have:
                lost += 1
                continue
            sent, started = sink.latency[-1]
            if i >= warmup:
                samples.append((started - sent) * 1000.0)
            time.sleep(0.02)  # let the worker go idle again
            if i >= warmup + ctx.sizes["latency_min"] and time.monotonic() - t_start > cap:
                break
        if lost:
            ctx.problem(broker.name, "latency", f"{lost} latency tasks did not start within 15s")
        if len(samples) < n:
            ctx.notes.append(
                f"{broker.name}: latency stopped at the {cap:.0f}s cap "
                f"with {len(samples)} of {n} samples (run {run + 1})"
            )
        if len(samples) >= min(10, ctx.sizes["latency_min"]):
            qs = statistics.quantiles(samples, n=100, method="inclusive")
            out.update(
                latency_p50=statistics.median(samples), latency_p95=qs[94], latency_p99=qs[98]
            )
    finally:
        app.close()
    return out


def bench_celery(ctx: Ctx, broker: Broker, run: int, want: set[str]) -> dict[str, float]:
    """Celery publish, drain (prefork, threads) and latency (on the prefork worker once idle)."""
    n = ctx.sizes["celery_n"]
    out: dict[str, float] = {}
    plans: list[tuple[str, str, int]] = []
    if want & {"drain_prefork", "latency"}:
        plans.append(("prefork", "prefork", 2))
    if "drain_threads" in want:
        plans.append(("threads", "threads", 8))
    if not plans:
        plans.append(("publish", "", 0))
    for tag, pool, conc in plans:
        name = ctx.queue(broker, f"c{run}{tag[:3]}")
        worker: Worker | None = None
        try:
            backlog = 0
            if "celery_publish" in want or f"drain_{tag}" in want:
                backlog, rate = publish_backlog(ctx, broker, name, n)
                if "celery_publish" in want and "celery_publish" not in out:
                    out["celery_publish"] = rate
            else:
                declare(broker, name)
            if not pool:
                continue
            worker = Worker(ctx, broker, name, pool, conc, tag=tag)
            if f"drain_{tag}" in want and backlog:
                r = drain(ctx, worker, broker, backlog, f"drain_{tag}")
                if r is not None:
                    out[f"drain_{tag}"] = r
            if tag == "prefork" and "latency" in want:
                out.update(measure_latency(ctx, worker, broker, name, run))
        finally:
            if worker is not None:
                worker.stop()
                if worker.killed:
                    ctx.notes.append(
                        f"{broker.name}: the {pool} worker did not exit within 5s of "
                        "SIGTERM and was killed"
                    )
            delete_queue(broker, name)
    return out


def describe_trace(trace: list[tuple[float, str, bytes]], seconds: float) -> str:
    """Executed statements by their first line, per minute, from a proxy trace."""
    import re
    from collections import Counter

    names: dict[bytes, str] = {}
    counts: Counter[str] = Counter()

    def label(query: bytes) -> str:
        text = query.decode(errors="replace").strip()
        first = text.splitlines()[0] if text else "?"
        return re.sub(r"\s+", " ", first)[:60]

    for _, kind, payload in trace:
        if kind == "P":
            name, _, rest = payload.partition(b"\0")
            names[name] = label(rest.split(b"\0")[0])
        elif kind == "B":
            _, _, rest = payload.partition(b"\0")
            stmt = rest.split(b"\0")[0]
            counts[names.get(stmt, "?")] += 1
        elif kind == "Q":
            counts[label(payload.rstrip(b"\0"))] += 1
    per_min = 60.0 / seconds if seconds else 0.0
    return "; ".join(f"{n * per_min:.0f} x {name!r}" for name, n in counts.most_common(8)) or "none"


def bench_idle(ctx: Ctx, brokers: list[Broker], run: int) -> dict[str, dict[str, float]]:
    """Idle prefork -c 2 workers of the PostgreSQL brokers, side by side, each behind its
    own counting proxy (idle workers only wake on timers, so they do not disturb each other)."""
    setups = []
    try:
        for broker in brokers:
            name = ctx.queue(broker, f"i{run}")
            declare(broker, name)
            proxy = CountingProxy(PG_HOSTPORT)
            worker = Worker(
                ctx, broker, name, "prefork", 2, url=broker.url_via(proxy.port), tag="idle"
            )
            setups.append((broker, name, proxy, worker))
        for _, _, _, worker in setups:
            worker.wait_ready()
        time.sleep(ctx.sizes["idle_settle"])
        before = [proxy.snapshot() for _, _, proxy, _ in setups]
        for _, _, proxy, _ in setups:
            proxy.trace = []
        t0 = time.monotonic()
        time.sleep(ctx.sizes["idle_window"])
        after = [proxy.snapshot() for _, _, proxy, _ in setups]
        dt = time.monotonic() - t0
        if run == 0:
            for broker, _, proxy, _ in setups:
                ctx.notes.append(
                    f"{broker.name}: idle worker statements by kind, per minute: "
                    + describe_trace(proxy.trace or [], dt)
                )
        out = {}
        for (broker, _, _, _), a, b in zip(setups, before, after):
            out[broker.name] = {
                "idle_stmts": (b["statements"] - a["statements"]) / dt,
                "idle_trips": (b["round_trips"] - a["round_trips"]) / dt,
                "idle_conns": float(b["open_connections"]),
            }
        return out
    finally:
        for broker, name, proxy, worker in setups:
            worker.stop()
            proxy.close()
            delete_queue(broker, name)


# -- pgqueue only ------------------------------------------------------------------


def _copy_rows(conn: psycopg.Connection, schema: str, queue: str, n: int) -> float:
    """COPY n small ready messages into queue; return rows/s."""
    body = "\\\\x" + (json.dumps(SMALL_BODY).encode().hex())
    headers = '{"id": "x"}'
    props = json.dumps(
        {"delivery_info": {"exchange": "", "routing_key": queue}, "body_encoding": "utf-8"}
    )
    line = f"{queue}\t{body}\tapplication/json\tutf-8\t{headers}\t{props}\n"
    chunk_rows = 10_000
    chunk = (line * chunk_rows).encode()
    t0 = time.perf_counter()
    with conn.cursor() as cur:
        stmt = psycopg.sql.SQL(
            "COPY {}.message (queue, body, content_type, content_encoding, headers, properties) "
            "FROM STDIN"
        ).format(psycopg.sql.Identifier(schema))
        with cur.copy(stmt) as copy:
            left = n
            while left > 0:
                k = min(left, chunk_rows)
                copy.write(chunk if k == chunk_rows else (line * k).encode())
                left -= k
    return n / (time.perf_counter() - t0)


def _store(broker: Broker):  # noqa: ANN202
    from kombu_pgqueue._options import build_conninfo, parse_options
    from kombu_pgqueue._store import Store

    options = parse_options(broker.options)
    conninfo = build_conninfo(
        hostname="127.0.0.1", port=5432, userid="postgres", password=None, virtual_host="test"
    )
    store = Store(conninfo, options)
    store.open()
    return store


def _claim_cost(store: Any, queue: str, limit: int, reps: int) -> float:
    """Mean ms of claim(limit) + ack of what it got, from the head of queue."""
    from kombu_pgqueue._store import new_lease

    total = 0.0
    for _ in range(reps):
        lease = new_lease()
        t0 = time.perf_counter()
        rows = store.claim(queue, limit, lease)
        if limit == 1:
            for r in rows:
                store.ack(r.id, lease)
        else:
            store.ack_many([r.id for r in rows], [lease] * len(rows))
        total += time.perf_counter() - t0
        if len(rows) < limit:
            raise RuntimeError(f"claim({limit}) on {queue} returned {len(rows)} rows")
    return total / reps * 1000.0


def bench_claim(ctx: Ctx, broker: Broker) -> dict[str, list[float]]:
    """Claim cost: small vs deep backlog, and after churn. Loads once, measures --runs times."""
    if broker.name != "pgqueue":
        return {}
    deep_n, reps = ctx.sizes["deep_n"], ctx.sizes["claim_reps"]
    schema = broker.options["schema"]
    store = _store(broker)
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "claim1_shallow",
            "claim1_deep",
            "claim100_shallow",
            "claim100_deep",
            "drain_shallow",
            "drain_deep",
        )
    }
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        log(f"  pgqueue: COPY {deep_n:,} messages into {schema}.message (deep backlog)")
        rate = _copy_rows(conn, schema, "deep", deep_n)
        delayed = deep_n // 10
        log(f"  pgqueue: loaded at {rate:,.0f} rows/s; {delayed:,} delayed ones beside them")
        conn.execute(
            psycopg.sql.SQL(
                "INSERT INTO {}.message (queue, delayed, next_iteration, body, content_type,"
                " content_encoding, headers, properties)"
                " SELECT 'deep', true, now() + interval '1 day' + n * interval '1 ms',"
                " '\\x7b7d', 'application/json', 'utf-8', '{{}}', '{{}}'"
                " FROM generate_series(1, %s) AS n"
            ).format(psycopg.sql.Identifier(schema)),
            (delayed,),
        )
        log("  pgqueue: VACUUM ANALYZE")
        conn.execute(
            psycopg.sql.SQL("VACUUM ANALYZE {}.message").format(psycopg.sql.Identifier(schema))
        )
        for r in range(ctx.runs):
            shallow = f"shallow{r}"
            _copy_rows(conn, schema, shallow, 10_000)
            conn.execute(
                psycopg.sql.SQL("ANALYZE {}.message").format(psycopg.sql.Identifier(schema))
            )
            _claim_cost(store, shallow, 1, 10)  # warm-up, prepares the statements
            _claim_cost(store, "deep", 1, 10)
            out["claim1_shallow"].append(_claim_cost(store, shallow, 1, reps))
            out["claim1_deep"].append(_claim_cost(store, "deep", 1, reps))
            out["claim100_shallow"].append(_claim_cost(store, shallow, 100, 20))
            out["claim100_deep"].append(_claim_cost(store, "deep", 100, 20))
            out["drain_shallow"].append(100_000 / out["claim100_shallow"][-1])
            out["drain_deep"].append(100_000 / out["claim100_deep"][-1])
            store.delete_queue(shallow)
        # churn: 50k claims+acks from the head of the deep queue leave dead index entries
        # in front of the live ones until (auto)vacuum runs
        conn.execute(
            psycopg.sql.SQL("ALTER TABLE {}.message SET (autovacuum_enabled = off)").format(
                psycopg.sql.Identifier(schema)
            )
        )
        try:
            _claim_cost(store, "deep", 100, ctx.sizes["churn_n"] // 100)
            out["claim1_churned"] = [_claim_cost(store, "deep", 1, reps) for _ in range(ctx.runs)]
            holder = conn.execute(
                "SELECT pid, application_name, state, "
                "greatest(age(backend_xmin), age(backend_xid)), "
                "now() - xact_start, left(regexp_replace(query, '\\s+', ' ', 'g'), 60) "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() "
                "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) "
                "ORDER BY 4 DESC NULLS LAST LIMIT 1"
            ).fetchone()
            ctx.notes.append(
                "pgqueue: churn measured with autovacuum off for the table; oldest snapshot in the "
                + (
                    "database then: none"
                    if not holder
                    else f"database then: {holder[3]} xids old, pid {holder[0]} "
                    f"({holder[1] or 'no app name'}, "
                    f"{holder[2]}, transaction open {holder[4]}, {holder[5]!r})"
                )
            )
            said: list[str] = []
            conn.add_notice_handler(lambda diag: said.append(diag.message_primary or ""))
            conn.execute(
                psycopg.sql.SQL("VACUUM (VERBOSE) {}.message").format(
                    psycopg.sql.Identifier(schema)
                )
            )
            detail = [
                line.strip()
                for text in said
                for line in text.splitlines()
                if "removable" in line or "tuples:" in line
            ]
            if detail:
                ctx.notes.append("pgqueue: VACUUM after churn said: " + "; ".join(detail[:2]))
            out["claim1_vacuumed"] = [_claim_cost(store, "deep", 1, reps) for _ in range(ctx.runs)]
        finally:
            conn.execute(
                psycopg.sql.SQL("ALTER TABLE {}.message RESET (autovacuum_enabled)").format(
                    psycopg.sql.Identifier(schema)
                )
            )
        store.delete_queue("deep")
    return out


def bench_bulk(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    """Bulk enqueue into an empty queue: Kombu level (Store) and Celery level (send_many)."""
    if broker.name != "pgqueue":
        return {}
    from celery_pgqueue.bulk import send_many

    n = ctx.sizes["bulk_n"]
    store = _store(broker)
    body = json.dumps(SMALL_BODY).encode()
    queue = f"bulk{run}"
    headers = '{"id": "x"}'
    properties = '{"delivery_info": {"exchange": "", "routing_key": "bulk"}}'
    # staging rows with a distinct dedup key each, as task ids give them (built untimed)
    rows = [
        (queue, 0, None, None, f"bulk:{run}:{i}", body, "application/json", "utf-8")
        + (headers, properties)
        for i in range(n)
    ]
    store.publish_rows(rows[:10])
    store.purge(queue)
    batch = 10_000
    t0 = time.perf_counter()
    done = 0
    for start in range(0, n, batch):
        done += store.publish_rows(rows[start : start + batch])
    out = {"bulk_publish_rows": n / (time.perf_counter() - t0)}
    if done != n:
        ctx.problem(broker.name, "bulk", f"publish_rows stored {done} of {n}")
    del rows
    store.purge(queue)

    tasks = ctx.sizes["bulk_tasks"]
    app = make_app(broker.url, broker.options, queue)
    noop = app.tasks["bench.noop"]
    send_many(app, [noop.s() for _ in range(10)])
    store.purge(queue)
    signatures = [noop.s() for _ in range(tasks)]
    t0 = time.perf_counter()
    report = send_many(app, signatures)
    out["bulk_send_many"] = tasks / (time.perf_counter() - t0)
    if report.enqueued != tasks:
        ctx.problem(broker.name, "bulk", f"send_many enqueued {report.enqueued} of {tasks}")
    app.close()
    store.purge(queue)

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        out["bulk_copy"] = _copy_rows(conn, broker.options["schema"], queue, n)
    store.delete_queue(queue)
    return out


# -- ETA tasks and worker memory -----------------------------------------------------


def queue_size(broker: Broker, name: str) -> int:
    """Messages waiting in the broker's queue (for pgqueue: delayed ones included)."""
    with Connection(broker.url, transport_options=broker.options) as conn:
        try:
            return int(kombu_queue(name)(conn.channel()).queue_declare(passive=True).message_count)
        except Exception:  # noqa: BLE001 - Redis forgets an empty queue
            return 0


def bench_eta_rss(ctx: Ctx, broker: Broker) -> dict[str, list[float]]:
    """Worker RSS with an empty queue, then with eta_n tasks due tomorrow (one run)."""
    if broker.name == "sqla":
        ctx.notes.append("sqla: ETA/RSS figure skipped (publishing at ~150 tasks/s takes too long)")
        return {}
    n, cap = ctx.sizes["eta_n"], ctx.sizes["eta_settle_cap"]
    name = ctx.queue(broker, "eta")
    declare(broker, name)
    worker = Worker(ctx, broker, name, "prefork", 2, tag="eta")
    app = make_app(broker.url, broker.options, name)
    try:
        worker.wait_ready()
        time.sleep(3.0)
        empty = worker.rss_mb()
        noop = app.tasks["bench.noop"]
        t0 = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for _ in range(n):
                noop.apply_async(countdown=86400, producer=producer)
        log(f"  {broker.name}: published {n:,} ETA tasks in {time.perf_counter() - t0:.1f}s")
        # settle: until the broker has handed every ETA task to the worker and RSS is flat
        # for 5 s, or nothing changed for 10 s, at most eta_settle_cap seconds
        deadline = time.monotonic() + cap
        last_rss, last_size = worker.rss_mb(), queue_size(broker, name)
        rss_since = size_since = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            rss, size = worker.rss_mb(), queue_size(broker, name)
            now = time.monotonic()
            if abs(rss - last_rss) > 1.0:
                last_rss, rss_since = rss, now
            if size != last_size:
                last_size, size_since = size, now
            if size == 0 and now - rss_since >= 5:
                break
            if now - rss_since >= 10 and now - size_since >= 10:
                break
        full = worker.rss_mb()
        held = n - queue_size(broker, name)
        if worker.proc.poll() is not None:
            ctx.problem(broker.name, "rss_eta", f"worker died:\n{worker.log_tail()}")
        if held < n and not broker.name.startswith("pgqueue"):
            ctx.notes.append(
                f"{broker.name}: after {cap:.0f}s the worker had taken {held:,} of {n:,} "
                "ETA tasks (it would keep taking them)"
            )
        return {"rss_empty": [empty], "rss_eta": [full], "eta_held": [float(held)]}
    finally:
        worker.stop()
        app.close()
        delete_queue(broker, name)


# ---------------------------------------------------------------------------------
# orchestration

GROUPS = ["kombu", "celery_publish", "drain", "latency", "idle", "claim", "bulk", "eta_rss"]
GROUP_FIGURES = {
    "kombu": ["kombu_publish", "kombu_consume"],
    "celery_publish": ["celery_publish"],
    "drain": ["drain_prefork", "drain_threads"],
    "latency": ["latency_p50", "latency_p95", "latency_p99"],
    "idle": ["idle_stmts", "idle_trips", "idle_conns"],
    "claim": [
        "claim1_shallow",
        "claim1_deep",
        "claim100_shallow",
        "claim100_deep",
        "drain_shallow",
        "drain_deep",
        "claim1_churned",
        "claim1_vacuumed",
    ],
    "bulk": ["bulk_publish_rows", "bulk_send_many", "bulk_copy"],
    "eta_rss": ["rss_empty", "rss_eta", "eta_held"],
}
#: figures that only exist for some brokers
ONLY_FOR = {
    "idle": {"pgqueue", "sqla"},
    "claim": {"pgqueue"},
    "bulk": {"pgqueue"},
    "eta_rss": {"pgqueue", "redis", "rabbitmq"},
}
#: the opt-in asynchronous-commit variant is measured where publishing matters
VARIANT_GROUPS = {"kombu", "celery_publish", "drain", "latency"}


def run_all(ctx: Ctx, groups: list[str]) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    live = [b for b in ctx.brokers.values() if b.available]

    def record(broker: Broker, values: dict[str, Any]) -> None:
        for key, value in values.items():
            vals = value if isinstance(value, list) else [value]
            results.setdefault(key, {}).setdefault(broker.name, []).extend(vals)

    def guarded(broker: Broker, label: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        # a step that hangs prints every thread's stack (then goes on waiting)
        faulthandler.dump_traceback_later(STEP_WATCHDOG, repeat=True)
        try:
            record(broker, fn())
        except Exception as exc:  # noqa: BLE001
            ctx.problem(
                broker.name, label, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            )
        finally:
            faulthandler.cancel_dump_traceback_later()
            if broker.name == "sqla":
                # Kombu's SQLAlchemy channel leaves its session idle in a transaction that
                # holds back the database's xmin horizon (no dead row anywhere in the
                # database, pgqueue's included, could be vacuumed): end it after each step
                close_sqla_sessions()
        log(f"  {broker.name:8s} {label:14s} {time.monotonic() - t0:6.1f}s")

    celery_want = set()
    if "celery_publish" in groups:
        celery_want.add("celery_publish")
    if "drain" in groups:
        celery_want.update(("drain_prefork", "drain_threads"))
    if "latency" in groups:
        celery_want.add("latency")
    for run in range(ctx.runs):
        log(f"run {run + 1}/{ctx.runs}")
        for b in live:
            if "kombu" in groups:
                guarded(b, "kombu", lambda b=b, run=run: bench_kombu(ctx, b, run))
            if celery_want:
                guarded(
                    b,
                    "celery+latency",
                    lambda b=b, run=run: bench_celery(ctx, b, run, celery_want),
                )
            if "bulk" in groups and b.name in ONLY_FOR["bulk"]:
                guarded(b, "bulk", lambda b=b, run=run: bench_bulk(ctx, b, run))
        idle = [b for b in live if b.name in ONLY_FOR["idle"]]
        if "idle" in groups and idle:
            t0 = time.monotonic()
            try:
                for name, values in bench_idle(ctx, idle, run).items():
                    record(ctx.brokers[name], values)
            except Exception as exc:  # noqa: BLE001
                ctx.problem(
                    ",".join(b.name for b in idle),
                    "idle",
                    f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                )
            finally:
                if any(b.name == "sqla" for b in idle):
                    close_sqla_sessions()
            log(f"  {'+'.join(b.name for b in idle):8s} idle {time.monotonic() - t0:6.1f}s")
    if "claim" in groups and "pgqueue" in ctx.brokers and ctx.brokers["pgqueue"].available:
        log("claim cost (loaded once, measured --runs times)")
        guarded(ctx.brokers["pgqueue"], "claim", lambda: bench_claim(ctx, ctx.brokers["pgqueue"]))
    if "eta_rss" in groups:
        log("worker RSS with ETA tasks (one run)")
        for b in live:
            if b.name in ONLY_FOR["eta_rss"]:
                guarded(b, "eta_rss", lambda b=b: bench_eta_rss(ctx, b))
    return results


# -- cleanup -----------------------------------------------------------------------------


def close_sqla_sessions() -> None:
    import gc

    from kombu.transport.sqlalchemy import Channel as SqlaChannel
    from sqlalchemy.orm import Session

    for obj in gc.get_objects():
        if isinstance(obj, Session):
            try:
                obj.close()
            except Exception:  # noqa: BLE001,S110
                pass
    for engine, _ in list(SqlaChannel._engines.values()):
        engine.dispose()
    SqlaChannel._engines.clear()


def drop_schema(schema: str) -> None:
    """Drop one of this run's schemas, ending this run's sessions that still lock its tables."""
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l "
            "JOIN pg_class AS c ON c.oid = l.relation "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND l.pid <> pg_backend_pid()",
            (schema,),
        )
        conn.execute("SET lock_timeout = '20s'")
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(schema)
            )
        )


def cleanup(ctx: Ctx) -> None:
    for worker in list(Worker.all):
        try:
            worker.stop(grace=5)
        except Exception as exc:  # noqa: BLE001
            log(f"warning: stopping worker {worker.proc.pid}: {exc!r}")
    prefix = ctx.prefix
    for name, broker in ctx.brokers.items():
        if not broker.available:
            continue
        try:
            if name.startswith("rabbitmq"):
                with Connection(broker.url) as conn:
                    ch = conn.channel()
                    for q in sorted(ctx.queues.get(name, ())):
                        try:
                            ch.queue_delete(q)
                        except Exception:  # noqa: BLE001
                            ch = conn.channel()
                    for q in sorted(ctx.queues.get(name, ())):
                        try:
                            ch.exchange_delete(q)
                        except Exception:  # noqa: BLE001
                            ch = conn.channel()
            elif name == "redis":
                import redis as redis_lib

                r = redis_lib.Redis.from_url(broker.url)
                for key in r.scan_iter(count=1000):
                    k = key.decode(errors="replace")
                    if prefix in k:
                        r.delete(key)
                    elif k.startswith("_kombu.binding."):
                        for member in r.smembers(key):
                            if prefix.encode() in member:
                                r.srem(key, member)
                # binding deadlines of exchanges whose bindings are all gone now
                for member in r.zrange(b"_kombu.binding_deadlines", 0, -1):
                    if not r.exists(b"_kombu.binding." + member):
                        r.zrem(b"_kombu.binding_deadlines", member)
                for field_, val in list(r.hscan_iter(b"unacked")):
                    if prefix.encode() in val:
                        r.hdel(b"unacked", field_)
                        r.zrem(b"unacked_index", field_)
            elif name.startswith("pgqueue"):
                drop_schema(broker.options["schema"])
            elif name == "sqla":
                # Kombu's SQLAlchemy channel never closes its session, which stays idle
                # in a transaction (queue_declare's SELECT count(*)) and would block the DROP
                close_sqla_sessions()
                drop_schema(f"{prefix}_sqla")
        except Exception as exc:  # noqa: BLE001
            log(f"warning: cleanup of {name} failed: {exc!r}")


# -- reporting ---------------------------------------------------------------------------


def fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def cell(vals: list[float] | None) -> str:
    if not vals:
        return ""
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt(med)
    return f"{fmt(med)} [{fmt(min(vals))}-{fmt(max(vals))}]"


def build_table(
    ctx: Ctx, results: dict[str, dict[str, list[float]]], groups: list[str]
) -> list[list[str]]:
    names = list(ctx.brokers)
    peers = [n for n in names if not n.startswith("pgqueue")]
    variant = "pgqueue_async" if "pgqueue_async" in names else None
    header = ["figure", "unit", "better"] + names + [f"pg/{p}" for p in peers]
    if variant:
        header += [f"async/{p}" for p in peers]
    rows = [header]
    for group in groups:
        for key in GROUP_FIGURES[group]:
            label, unit, better = FIGURES[key]
            label = label.replace("churn_n", f"{ctx.sizes['churn_n'] // 1000}k")
            row = [label, unit, better]
            per = results.get(key, {})
            for n in names:
                b = ctx.brokers[n]
                if not b.available:
                    row.append("absent")
                elif group in ONLY_FOR and n not in ONLY_FOR[group]:
                    row.append("n/a")
                elif n in ("pgqueue_async", "rabbitmq_confirm") and group not in VARIANT_GROUPS:
                    row.append("n/a")
                elif not per.get(n):
                    row.append(
                        "FAILED" if group not in ("claim", "bulk") or n == "pgqueue" else "n/a"
                    )
                else:
                    row.append(cell(per[n]))
            for ours in ["pgqueue"] + ([variant] if variant else []):
                pg = per.get(ours)
                for p in peers:
                    pv = per.get(p)
                    if pg and pv and statistics.median(pv) > 0:
                        row.append(f"{statistics.median(pg) / statistics.median(pv):.2f}")
                    else:
                        row.append("-")
            rows.append(row)
    return rows


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(r))
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


METHOD = """\
Method
- Every figure: median of --runs runs [min-max]; ratio = pgqueue median / peer median
  (for "higher" figures above 1 favours pgqueue, for "lower" figures below 1 does).
  Brokers are interleaved within each run, so background load hits all of them alike.
- Kombu: Producer.publish (default exchange, ~90-byte JSON body) in one process after 100
  warm-up messages, then a Consumer with prefetch_count=100 drains that backlog, acking
  each message. For pgqueue the table is checked to be empty afterwards.
- Celery publish: apply_async() of a no-op task from one process (json, no results),
  after 20 warm-up calls. Slow brokers publish what fits in a time cap.
- Celery drain: that backlog is published first, then
  `python -m celery -A bench_app worker --pool P -c C --without-mingle --without-gossip`
  starts. Worker signal handlers append one line per task (task_prerun time, task_postrun
  time, task id) to a local file with a single O_APPEND write - no network, identical for
  every broker. Rate = tasks / (last postrun - first prerun); worker start-up is excluded.
  Every task id must appear (lost tasks are reported), duplicates are reported.
- Latency: the prefork -c 2 worker, once it has drained its backlog and idled 1 s; the
  producer passes time.time() as the argument, the task appends its own time.time() at
  start to the same file; sequential, 20 ms apart, 5 warm-up tasks dropped. Includes the
  apply_async call itself. Slow brokers stop at a time cap (at least a minimum sample).
- Idle cost (PostgreSQL brokers only): an idle prefork -c 2 worker per broker, side by
  side, each connected through its own counting proxy (pgproxy.py) that parses the client
  side of the wire protocol, so only that worker's traffic is counted (pg_stat_statements
  is not loaded on this server and pg_stat_database counts every session). Statements =
  Query + Execute messages; round trips = Query + Sync messages; counted over a fixed
  window after a settle period; connections = server connections open at the end.
  Statements include BEGIN/COMMIT/SET and, for every broker alike, Celery's worker
  heartbeat event (a publish every 2 s; the worker runs without --without-heartbeat).
- claim (pgqueue only): kombu_pgqueue._store.Store.claim + ack (or ack_many) from the head
  of a queue, mean over many calls, against a backlog COPY-loaded straight into the
  benchmark schema's message table and VACUUM ANALYZEd; then 50k claims+acks from the
  head with autovacuum off for the table, measured again, then after a manual VACUUM.
- bulk (pgqueue only): Store.publish_rows in batches of 10,000 rows, each with its own
  dedup key (the Kombu-level bulk path: COPY straight into the table, falling back to
  staging + INSERT ... ON CONFLICT when a key is taken); celery_pgqueue send_many of
  no-op signatures built beforehand (message building included); raw COPY for reference.
- ETA RSS: summed VmRSS of the worker's process group (prefork -c 2) with an empty
  queue, then after apply_async(countdown=86400) of N no-op tasks once the worker settles
  (broker queue empty and RSS flat 5 s, or nothing changing for 10 s, or a time cap);
  "held" = tasks no longer waiting in the broker's queue, i.e. in the worker's memory."""


def code_state() -> str:
    """kombu_pgqueue's commit, and a digest of its uncommitted changes if any."""
    import hashlib

    try:
        head = subprocess.run(
            ["git", "-C", ROOT, "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", ROOT, "diff", "HEAD", "--", "kombu_pgqueue"],
            capture_output=True,
            timeout=5,
        ).stdout
        state = f"kombu_pgqueue at {head[:90]}"
        if diff:
            state += f" + uncommitted changes (diff {hashlib.sha1(diff).hexdigest()[:8]})"
        return state
    except Exception:  # noqa: BLE001
        return "kombu_pgqueue: git state unknown"


def machine_info(ctx: Ctx) -> list[str]:
    import celery
    import kombu
    import sqlalchemy

    try:
        import redis as redis_lib

        redis_version = redis_lib.__version__
    except ImportError:
        redis_version = "absent"

    info = [
        f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}",
        ctx.code_at_start,
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"host: {platform.platform()}, nproc={os.cpu_count()}",
        f"python {platform.python_version()}, celery {celery.__version__}, "
        f"kombu {kombu.__version__}, "
        f"redis-py {redis_version}, psycopg {psycopg.__version__}, "
        f"sqlalchemy {sqlalchemy.__version__}",
    ]
    try:
        free = subprocess.run(["free", "-h"], capture_output=True, text=True, timeout=5).stdout
        info.append("memory: " + " ".join(free.splitlines()[1].split()[1:3]) + " (total, used)")
    except Exception:  # noqa: BLE001,S110
        pass
    try:
        with psycopg.connect(PG_DSN) as conn:
            info.append("server: " + conn.execute("SELECT version()").fetchone()[0])
            settings = conn.execute(
                "SELECT string_agg(name || '=' || setting, ', ' ORDER BY name) FROM pg_settings "
                "WHERE name IN ('shared_buffers','synchronous_commit','fsync','max_connections')"
            ).fetchone()[0]
            info.append("server settings: " + settings)
    except Exception as exc:  # noqa: BLE001
        info.append(f"server: ? ({exc!r})")
    if "redis" in ctx.brokers and ctx.brokers["redis"].available:
        try:
            r = redis_lib.Redis.from_url(ctx.brokers["redis"].url)
            info.append(f"server: Redis {r.info('server')['redis_version']}")
        except Exception:  # noqa: BLE001,S110
            pass
    if "rabbitmq" in ctx.brokers and ctx.brokers["rabbitmq"].version:
        v = ctx.brokers["rabbitmq"].version
        info.append("server: " + (v if isinstance(v, str) else str(v)))
    info.append(
        "celery settings (all brokers): "
        + ", ".join(f"{k}={v!r}" for k, v in COMMON_SETTINGS.items())
    )
    info.append("worker flags (all brokers): " + " ".join(WORKER_FLAGS))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="runs per figure (median, min-max); default 3, or 1 with --quick",
    )
    parser.add_argument("--only", default="", help="comma-separated: " + ",".join(GROUPS))
    parser.add_argument(
        "--brokers", default="pgqueue,pgqueue_async,redis,rabbitmq,rabbitmq_confirm,sqla"
    )
    parser.add_argument("--deep", type=int, default=None, help="deep-backlog size for 'claim'")
    parser.add_argument("--eta", type=int, default=None, help="number of ETA tasks for 'eta_rss'")
    parser.add_argument("--markdown", default=None, help="also write the report as Markdown here")
    parser.add_argument("--json", default=None, help="also write raw results as JSON here")
    args = parser.parse_args(argv)

    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    groups = [g.strip() for g in args.only.split(",") if g.strip()] or list(GROUPS)
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        parser.error(f"unknown --only names {bad}; choose from {GROUPS}")
    groups = [g for g in GROUPS if g in groups]
    wanted = [b.strip() for b in args.brokers.split(",") if b.strip()]
    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.deep:
        sizes["deep_n"] = args.deep
    if args.eta:
        sizes["eta_n"] = args.eta

    runid = uuid.uuid4().hex[:8]
    prefix = f"bench_{runid}"
    all_brokers = make_brokers(prefix)
    unknown = [b for b in wanted if b not in all_brokers]
    if unknown:
        parser.error(f"unknown brokers {unknown}")
    brokers = {n: all_brokers[n] for n in all_brokers if n in wanted}
    tmp = tempfile.mkdtemp(prefix=f"{prefix}-")
    ctx = Ctx(
        sizes=sizes,
        runs=args.runs,
        prefix=prefix,
        tmp=tmp,
        brokers=brokers,
        code_at_start=code_state(),
    )

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for b in brokers.values():
            probe(b)
            log(f"{b.name}: {'available' if b.available else 'ABSENT (' + b.why_absent + ')'}")
        log(f"groups: {','.join(groups)}; runs: {args.runs}; sizes: {sizes}")
        results = run_all(ctx, groups)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return_code = 130
    else:
        return_code = 0
    finally:
        cleanup(ctx)
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    if code_state() != ctx.code_at_start:
        ctx.notes.append(f"kombu_pgqueue CHANGED during the run: now {code_state()}")

    rows = build_table(ctx, results, groups)
    info = machine_info(ctx)
    absent = [f"{b.name}: absent ({b.why_absent})" for b in brokers.values() if not b.available]
    text = io.StringIO()
    print("", file=text)
    for line in info:
        print(line, file=text)
    print(f"sizes: {sizes}; runs: {args.runs}; wall time {elapsed / 60:.1f} min", file=text)
    print("", file=text)
    print(render_text(rows), file=text)
    print("", file=text)
    print(METHOD, file=text)
    for line in absent:
        print(line, file=text)
    if ctx.notes:
        print("\nNotes", file=text)
        for note in dict.fromkeys(ctx.notes):
            print("- " + note, file=text)
    if ctx.problems:
        print("\nPROBLEMS", file=text)
        for p in ctx.problems:
            print("- " + p, file=text)
    print(text.getvalue())

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                "```\n" + "\n".join(info) + f"\nsizes: {sizes}; runs: {args.runs}; "
                f"wall time {elapsed / 60:.1f} min\n```\n\n"
            )
            f.write(render_markdown(rows) + "\n\n```\n" + METHOD + "\n```\n")
            if absent or ctx.notes or ctx.problems:
                f.write(
                    "\n"
                    + "\n".join(
                        "- " + x
                        for x in absent
                        + list(dict.fromkeys(ctx.notes))
                        + ["PROBLEM " + p for p in ctx.problems]
                    )
                    + "\n"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "sizes": sizes,
                    "runs": args.runs,
                    "results": results,
                    "problems": ctx.problems,
                    "notes": ctx.notes,
                    "info": info,
                },
                f,
                indent=1,
            )
    return return_code or (1 if ctx.problems else 0)


if __name__ == "__main__":
    sys.exit(main())
