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
import threading
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
from kombu import Connection, Consumer, Exchange, Producer, Queue  # noqa: E402

import kombu_pgqueue  # noqa: E402,F401 - registers pgqueue://
from bench_app import COMMON_SETTINGS, make_app  # noqa: E402
from pgproxy import CountingProxy  # noqa: E402

PG_DSN = os.environ.get("BENCH_PG_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test")
PG_HOSTPORT = ("127.0.0.1", 5432)
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

WORKER_FLAGS = ["--without-mingle", "--without-gossip", "-l", "WARNING"]

SIZES = {
    "full": dict(
        kombu_n=5000, kombu_cap=20.0,
        celery_n=5000, drain_timeout=300.0,
        latency_n=200, latency_cap=40.0,
        idle_settle=5.0, idle_window=20.0,
        deep_n=2_000_000, claim_reps=200,
        bulk_n=100_000,
        eta_n=100_000,
    ),
    "quick": dict(
        kombu_n=1000, kombu_cap=8.0,
        celery_n=1000, drain_timeout=120.0,
        latency_n=50, latency_cap=12.0,
        idle_settle=3.0, idle_window=10.0,
        deep_n=200_000, claim_reps=100,
        bulk_n=20_000,
        eta_n=10_000,
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
        "redis": Broker("redis", REDIS_URL),
        "rabbitmq": Broker("rabbitmq", AMQP_URL),
        "sqla": Broker(
            "sqla",
            "sqla+postgresql+psycopg://postgres@127.0.0.1/test",
            {"queue_tablename": f"{prefix}_kombu_queue", "message_tablename": f"{prefix}_kombu_message"},
            url_via=lambda port: f"sqla+postgresql+psycopg://postgres@127.0.0.1:{port}/test",
        ),
    }


def probe(broker: Broker) -> None:
    try:
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

    def __init__(self, ctx: Ctx, broker: Broker, queue: str, pool: str, concurrency: int,
                 url: str | None = None, tag: str = "w") -> None:
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
            sys.executable, "-m", "celery", "-A", "bench_app", "worker",
            "--pool", pool, "-c", str(concurrency), *WORKER_FLAGS,
            "-n", f"{queue}-{tag}@%h",
        ]
        self._log = open(self.logfile, "wb")
        self.proc = subprocess.Popen(
            self.cmd, cwd=HERE, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.started = time.time()
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

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
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
    "claim1_churned": ("claim(1)+ack after 50k acks, no vacuum", "ms", "lower"),
    "bulk_publish_many": ("Store.publish_many, batches of 1000", "msg/s", "higher"),
    "bulk_copy": ("COPY into the message table", "msg/s", "higher"),
    "rss_empty": ("Worker RSS (prefork -c 2), empty queue", "MB", "lower"),
    "rss_eta": ("Worker RSS with ETA tasks due tomorrow", "MB", "lower"),
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
        producer.publish(SMALL_BODY, routing_key=name)  # warm-up (connection, prepare)
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
            ctx.notes.append(f"{broker.name}: kombu publish stopped at the {cap:.0f}s cap "
                             f"after {published} of {n} messages")
        got = 0

        def on_message(body: Any, message: Any) -> None:
            nonlocal got
            message.ack()
            got += 1

        consumer = Consumer(ch, [queue], callbacks=[on_message], prefetch_count=100,
                            accept=["json"])
        deadline = time.monotonic() + max(60.0, published / 50)
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
        if got < published:
            ctx.problem(broker.name, "kombu_consume",
                        f"consumed {got} of {published} messages before the deadline")
        else:
            out["kombu_consume"] = got / elapsed
        try:
            left = bound.queue_declare(passive=True).message_count
        except Exception:  # noqa: BLE001 - Redis forgets an empty queue
            left = 0
        if left:
            ctx.problem(broker.name, "kombu_consume", f"{left} messages left after draining")
        bound.delete()
    return out


def publish_backlog(ctx: Ctx, broker: Broker, name: str, n: int) -> float:
    """apply_async n no-op tasks from this process; return tasks/s."""
    declare(broker, name)
    app = make_app(broker.url, broker.options, name)
    try:
        noop = app.tasks["bench.noop"]
        noop.apply_async()  # warm-up: connection, producer pool, declarations
        t0 = time.perf_counter()
        for _ in range(n - 1):
            noop.apply_async()
        return (n - 1) / (time.perf_counter() - t0)
    finally:
        app.close()


def drain(ctx: Ctx, broker: Broker, name: str, n: int, pool: str, conc: int, figure: str) -> float | None:
    worker = Worker(ctx, broker, name, pool, conc, tag=pool)
    try:
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
            ctx.problem(broker.name, figure,
                        f"only {unique} of {n} tasks ran within {ctx.sizes['drain_timeout']:.0f}s "
                        f"(log tail:\n{worker.log_tail(15)})")
            return None
        if len(ids) > unique:
            ctx.problem(broker.name, figure, f"{len(ids) - unique} tasks ran twice")
        first = min(d[0] for d in sink.done)
        last = max(d[1] for d in sink.done)
        return n / (last - first)
    finally:
        worker.stop()


def bench_celery(ctx: Ctx, broker: Broker, run: int, want: set[str]) -> dict[str, float]:
    n = ctx.sizes["celery_n"]
    out: dict[str, float] = {}
    plans = [p for p in ("drain_prefork", "drain_threads") if p in want]
    if not plans:
        plans = [None]  # publish only
    for plan in plans:
        name = ctx.queue(broker, f"c{run}{(plan or 'pub')[6:9]}")
        try:
            rate = publish_backlog(ctx, broker, name, n)
            if "celery_publish" in want and "celery_publish" not in out:
                out["celery_publish"] = rate
            if plan == "drain_prefork":
                r = drain(ctx, broker, name, n, "prefork", 2, plan)
            elif plan == "drain_threads":
                r = drain(ctx, broker, name, n, "threads", 8, plan)
            else:
                r = None
            if plan and r is not None:
                out[plan] = r
        finally:
            delete_queue(broker, name)
    return out


def bench_latency(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    n, cap = ctx.sizes["latency_n"], ctx.sizes["latency_cap"]
    name = ctx.queue(broker, f"l{run}")
    declare(broker, name)
    app = make_app(broker.url, broker.options, name)
    worker = Worker(ctx, broker, name, "prefork", 2, tag="lat")
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
            if i >= warmup + 20 and time.monotonic() - t_start > cap:
                break
        if lost:
            ctx.problem(broker.name, "latency", f"{lost} latency tasks did not start within 15s")
        if len(samples) < n:
            ctx.notes.append(f"{broker.name}: latency run {run + 1} stopped at the {cap:.0f}s cap "
                             f"with {len(samples)} of {n} samples")
        if len(samples) >= 10:
            qs = statistics.quantiles(samples, n=100, method="inclusive")
            out.update(latency_p50=statistics.median(samples), latency_p95=qs[94], latency_p99=qs[98])
    finally:
        worker.stop()
        app.close()
        delete_queue(broker, name)
    return out


def bench_idle(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    if broker.url_via is None:
        return {}
    name = ctx.queue(broker, f"i{run}")
    declare(broker, name)
    proxy = CountingProxy(PG_HOSTPORT)
    worker = Worker(ctx, broker, name, "prefork", 2, url=broker.url_via(proxy.port), tag="idle")
    try:
        worker.wait_ready()
        time.sleep(ctx.sizes["idle_settle"])
        a = proxy.snapshot()
        t0 = time.monotonic()
        time.sleep(ctx.sizes["idle_window"])
        b = proxy.snapshot()
        dt = time.monotonic() - t0
        return {
            "idle_stmts": (b["statements"] - a["statements"]) / dt,
            "idle_trips": (b["round_trips"] - a["round_trips"]) / dt,
            "idle_conns": float(b["open_connections"]),
        }
    finally:
        worker.stop()
        proxy.close()
        delete_queue(broker, name)


# -- pgqueue only ------------------------------------------------------------------


def _copy_rows(conn: psycopg.Connection, schema: str, queue: str, n: int) -> float:
    """COPY n small ready messages into queue; return rows/s."""
    body = "\\\\x" + (json.dumps(SMALL_BODY).encode().hex())
    headers = '{"id": "x"}'
    props = '{"delivery_info": {"exchange": "", "routing_key": "%s"}, "body_encoding": "utf-8"}' % queue
    line = f"{queue}\t{body}\tapplication/json\tutf-8\t{headers}\t{props}\n"
    chunk_rows = 10_000
    chunk = (line * chunk_rows).encode()
    t0 = time.perf_counter()
    with conn.cursor() as cur:
        stmt = psycopg.sql.SQL(
            "COPY {}.message (queue, body, content_type, content_encoding, headers, properties) FROM STDIN"
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
    conninfo = build_conninfo(hostname="127.0.0.1", port=5432, userid="postgres", password=None,
                              virtual_host="test")
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
    out: dict[str, list[float]] = {k: [] for k in
                                   ("claim1_shallow", "claim1_deep", "claim100_shallow", "claim100_deep")}
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        log(f"  pgqueue: COPY {deep_n:,} messages into {schema}.message (deep backlog)")
        rate = _copy_rows(conn, schema, "deep", deep_n)
        log(f"  pgqueue: loaded at {rate:,.0f} rows/s; VACUUM ANALYZE")
        conn.execute(psycopg.sql.SQL("VACUUM ANALYZE {}.message").format(psycopg.sql.Identifier(schema)))
        for r in range(ctx.runs):
            shallow = f"shallow{r}"
            _copy_rows(conn, schema, shallow, 10_000)
            conn.execute(psycopg.sql.SQL("ANALYZE {}.message").format(psycopg.sql.Identifier(schema)))
            _claim_cost(store, shallow, 1, 10)  # warm-up, prepares the statements
            _claim_cost(store, "deep", 1, 10)
            out["claim1_shallow"].append(_claim_cost(store, shallow, 1, reps))
            out["claim1_deep"].append(_claim_cost(store, "deep", 1, reps))
            out["claim100_shallow"].append(_claim_cost(store, shallow, 100, 20))
            out["claim100_deep"].append(_claim_cost(store, "deep", 100, 20))
            store.delete_queue(shallow)
        # churn: 50k claims+acks from the head of the deep queue leave dead index entries
        # in front of the live ones until (auto)vacuum runs
        conn.execute(psycopg.sql.SQL("ALTER TABLE {}.message SET (autovacuum_enabled = off)")
                     .format(psycopg.sql.Identifier(schema)))
        try:
            _claim_cost(store, "deep", 100, 500)
            out["claim1_churned"] = [_claim_cost(store, "deep", 1, reps) for _ in range(ctx.runs)]
        finally:
            conn.execute(psycopg.sql.SQL("ALTER TABLE {}.message RESET (autovacuum_enabled)")
                         .format(psycopg.sql.Identifier(schema)))
        store.delete_queue("deep")
    return out


def bench_bulk(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    if broker.name != "pgqueue":
        return {}
    from kombu_pgqueue._store import Outgoing

    n = ctx.sizes["bulk_n"]
    store = _store(broker)
    body = json.dumps(SMALL_BODY).encode()
    queue = f"bulk{run}"
    msgs = [
        Outgoing(queue=queue, body=body, headers='{"id": "x"}',
                 properties='{"delivery_info": {"exchange": "", "routing_key": "bulk"}}',
                 content_type="application/json", content_encoding="utf-8")
        for _ in range(1000)
    ]
    store.publish_many(msgs[:10])
    store.purge(queue)
    t0 = time.perf_counter()
    done = 0
    while done < n:
        done += store.publish_many(msgs[: min(1000, n - done)])
    out = {"bulk_publish_many": n / (time.perf_counter() - t0)}
    store.purge(queue)
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        out["bulk_copy"] = _copy_rows(conn, broker.options["schema"], queue, n)
    store.delete_queue(queue)
    return out


# -- ETA tasks and worker memory -----------------------------------------------------


def bench_eta_rss(ctx: Ctx, broker: Broker) -> dict[str, list[float]]:
    """Worker RSS with an empty queue, then with eta_n tasks due tomorrow (one run)."""
    if broker.name == "sqla":
        ctx.notes.append("sqla: ETA/RSS figure skipped (publishing 100k tasks at ~400/s "
                         "would take minutes)")
        return {}
    n = ctx.sizes["eta_n"]
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
        # wait for the worker to settle: RSS unchanged (within 1 MB) for 5 s, at most 90 s
        stable_since, last = time.monotonic(), worker.rss_mb()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and time.monotonic() - stable_since < 5:
            time.sleep(1.0)
            now = worker.rss_mb()
            if abs(now - last) > 1.0:
                stable_since, last = time.monotonic(), now
        full = worker.rss_mb()
        if worker.proc.poll() is not None:
            ctx.problem(broker.name, "rss_eta", f"worker died:\n{worker.log_tail()}")
        return {"rss_empty": [empty], "rss_eta": [full]}
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
    "claim": ["claim1_shallow", "claim1_deep", "claim100_shallow", "claim100_deep", "claim1_churned"],
    "bulk": ["bulk_publish_many", "bulk_copy"],
    "eta_rss": ["rss_empty", "rss_eta"],
}
#: figures that only exist for some brokers
ONLY_FOR = {
    "idle": {"pgqueue", "sqla"},
    "claim": {"pgqueue"},
    "bulk": {"pgqueue"},
    "eta_rss": {"pgqueue", "redis", "rabbitmq"},
}


def run_all(ctx: Ctx, groups: list[str]) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    live = [b for b in ctx.brokers.values() if b.available]

    def record(broker: Broker, values: dict[str, Any]) -> None:
        for key, value in values.items():
            vals = value if isinstance(value, list) else [value]
            results.setdefault(key, {}).setdefault(broker.name, []).extend(vals)

    def guarded(broker: Broker, label: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        try:
            record(broker, fn())
        except Exception as exc:  # noqa: BLE001
            ctx.problem(broker.name, label, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        log(f"  {broker.name:8s} {label:14s} {time.monotonic() - t0:6.1f}s")

    celery_want = set()
    if "celery_publish" in groups:
        celery_want.add("celery_publish")
    if "drain" in groups:
        celery_want.update(("drain_prefork", "drain_threads"))
    for run in range(ctx.runs):
        log(f"run {run + 1}/{ctx.runs}")
        for b in live:
            if "kombu" in groups:
                guarded(b, "kombu", lambda b=b: bench_kombu(ctx, b, run))
            if celery_want:
                guarded(b, "celery", lambda b=b: bench_celery(ctx, b, run, celery_want))
            if "latency" in groups:
                guarded(b, "latency", lambda b=b: bench_latency(ctx, b, run))
            if "idle" in groups and b.name in ONLY_FOR["idle"]:
                guarded(b, "idle", lambda b=b: bench_idle(ctx, b, run))
            if "bulk" in groups and b.name in ONLY_FOR["bulk"]:
                guarded(b, "bulk", lambda b=b: bench_bulk(ctx, b, run))
    if "claim" in groups and ctx.brokers["pgqueue"].available:
        log("claim cost (loaded once, measured --runs times)")
        guarded(ctx.brokers["pgqueue"], "claim", lambda: bench_claim(ctx, ctx.brokers["pgqueue"]))
    if "eta_rss" in groups:
        log("worker RSS with ETA tasks (one run)")
        for b in live:
            guarded(b, "eta_rss", lambda b=b: bench_eta_rss(ctx, b))
    return results


# -- cleanup -----------------------------------------------------------------------------


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
            if name == "rabbitmq":
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
                for key in (b"unacked", b"unacked_index"):
                    if r.type(key) == b"hash":
                        for field_, val in r.hscan_iter(key):
                            if prefix.encode() in val:
                                r.hdel(key, field_)
                    elif r.type(key) == b"zset":
                        pass
            elif name == "pgqueue":
                with psycopg.connect(PG_DSN, autocommit=True) as conn:
                    conn.execute(psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE")
                                 .format(psycopg.sql.Identifier(broker.options["schema"])))
            elif name == "sqla":
                with psycopg.connect(PG_DSN, autocommit=True) as conn:
                    for t in (broker.options["message_tablename"], broker.options["queue_tablename"]):
                        conn.execute(psycopg.sql.SQL("DROP TABLE IF EXISTS {} CASCADE")
                                     .format(psycopg.sql.Identifier(t)))
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


def build_table(ctx: Ctx, results: dict[str, dict[str, list[float]]], groups: list[str]) -> list[list[str]]:
    names = list(ctx.brokers)
    peers = [n for n in names if n != "pgqueue"]
    header = ["figure", "unit", "better"] + names + [f"pg/{p}" for p in peers]
    rows = [header]
    for group in groups:
        for key in GROUP_FIGURES[group]:
            label, unit, better = FIGURES[key]
            row = [label, unit, better]
            per = results.get(key, {})
            for n in names:
                b = ctx.brokers[n]
                if not b.available:
                    row.append("absent")
                elif group in ONLY_FOR and n not in ONLY_FOR[group]:
                    row.append("n/a")
                elif not per.get(n):
                    row.append("FAILED" if group not in ("claim", "bulk") or n == "pgqueue" else "n/a")
                else:
                    row.append(cell(per[n]))
            pg = per.get("pgqueue")
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
        lines.append("  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(r)))
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
  (above 1 is better for pgqueue where "better" is higher, worse where it is lower).
- Kombu: Producer.publish (default exchange, ~90-byte JSON body) in one process, then a
  Consumer with prefetch_count=100 drains that backlog, acking each message.
- Celery publish: apply_async() of a no-op task from one process (json, no results).
- Celery drain: a backlog of N no-op tasks is published first, then
  `python -m celery -A bench_app worker --pool P -c C --without-mingle --without-gossip`
  starts. Worker signal handlers append one line per task (task_prerun time, task_postrun
  time, task id) to a local file with a single O_APPEND write - no network, identical for
  every broker. Rate = N / (last postrun - first prerun); worker start-up is excluded.
  Every task id must appear (lost tasks are reported), duplicates are reported.
- Latency: an idle prefork -c 2 worker; the producer sends time.time() as the argument, the
  task writes its own time.time() at start to the same file; sequential, 20 ms apart,
  5 warm-up tasks dropped. Includes the apply_async call itself.
- Idle cost (PostgreSQL brokers only): the idle prefork -c 2 worker connects through a
  counting proxy (pgproxy.py) that parses the client side of the wire protocol, so only
  this worker's traffic is counted (pg_stat_statements is not loaded here and
  pg_stat_database counts every session). Statements = Query + Execute messages; round
  trips = Query + Sync messages; measured after a settle period, over a fixed window.
- claim/bulk (pgqueue only): kombu_pgqueue._store.Store called directly against a backlog
  COPY-loaded into the benchmark schema's message table and VACUUM ANALYZEd.
- ETA RSS: summed VmRSS of the worker's process group (prefork -c 2) with an empty queue
  and after apply_async(countdown=86400) of N no-op tasks, once RSS is stable for 5 s."""


def machine_info(ctx: Ctx) -> list[str]:
    import celery
    import kombu
    import redis as redis_lib
    import sqlalchemy

    info = [f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}",
            f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"host: {platform.platform()}, nproc={os.cpu_count()}",
            f"python {platform.python_version()}, celery {celery.__version__}, kombu {kombu.__version__}, "
            f"redis-py {redis_lib.__version__}, psycopg {psycopg.__version__}, "
            f"sqlalchemy {sqlalchemy.__version__}"]
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
    if ctx.brokers["redis"].available:
        try:
            r = redis_lib.Redis.from_url(ctx.brokers["redis"].url)
            info.append(f"server: Redis {r.info('server')['redis_version']}")
        except Exception:  # noqa: BLE001,S110
            pass
    if ctx.brokers["rabbitmq"].version:
        v = ctx.brokers["rabbitmq"].version
        info.append("server: " + (v if isinstance(v, str) else str(v)))
    info.append("celery settings (all brokers): " + ", ".join(f"{k}={v!r}" for k, v in COMMON_SETTINGS.items()))
    info.append("worker flags (all brokers): " + " ".join(WORKER_FLAGS))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated: " + ",".join(GROUPS))
    parser.add_argument("--brokers", default="pgqueue,redis,rabbitmq,sqla")
    parser.add_argument("--deep", type=int, default=None, help="deep-backlog size for 'claim'")
    parser.add_argument("--eta", type=int, default=None, help="number of ETA tasks for 'eta_rss'")
    parser.add_argument("--markdown", default=None, help="also write the report as Markdown here")
    parser.add_argument("--json", default=None, help="also write raw results as JSON here")
    args = parser.parse_args(argv)

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
    ctx = Ctx(sizes=sizes, runs=args.runs, prefix=prefix, tmp=tmp, brokers=brokers)

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
            f.write("```\n" + "\n".join(info) + f"\nsizes: {sizes}; runs: {args.runs}; "
                    f"wall time {elapsed / 60:.1f} min\n```\n\n")
            f.write(render_markdown(rows) + "\n\n```\n" + METHOD + "\n```\n")
            if absent or ctx.notes or ctx.problems:
                f.write("\n" + "\n".join("- " + x for x in absent + list(dict.fromkeys(ctx.notes))
                                          + ["PROBLEM " + p for p in ctx.problems]) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": sizes, "runs": args.runs, "results": results,
                       "problems": ctx.problems, "notes": ctx.notes, "info": info}, f, indent=1)
    return return_code or (1 if ctx.problems else 0)


if __name__ == "__main__":
    sys.exit(main())
