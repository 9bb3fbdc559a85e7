"""The ``fleet`` group: many idle workers on one database with a managed server's
connection limit, directly and through PgBouncer in transaction mode (issue 43).

A throwaway cluster (``tests/clusters.py``) with ``max_connections = 100``, and for the
pooled rows a real PgBouncer in front of it (``tests/pgbouncer.py``: transaction mode,
40 server sessions). For 1, 50 and 200 idle consumers, each a real consumer process (a
Kombu consumer of queue ``fleet`` in ``drain_events``, as a Celery worker's main process
consumes), started one after the other:

- *sessions*: the cluster's client sessions once they all run, and how many of the
  consumers could start (a direct consumer holds a session of its own; past the limit
  the server refuses it);
- *publish rate*: one publisher process publishes to ``fleet`` for a window, as fast as
  it can, while the consumers take the messages;
- *latency*: then 200 messages a second for a window, each carrying its publish time;
  the consumer that gets one reports publish-to-delivery (p50, p99);
- *server CPU per publish*: the cluster's CPU-seconds over the rate window / publishes.

Direct consumers LISTEN (wakeups by NOTIFY) each; relayed ones (transport option
``relay``) share one LISTEN session, the host relay's; pooled ones poll (no
``listen_url``), as a pooler-only deployment does, each (``pgbouncer``) or their host's
relay for all (``pgbouncer_relay``). Each row's figures go beside the
1-consumer row's of its mode. The same consumers and publisher against RabbitMQ and
Redis, side by side, give their servers' client connections (``rabbitmqctl
list_connections``, Redis' ``INFO clients``), rate and latency. Run:
``python -m benchmarks --only fleet`` (``--runs N`` repeats the sweep, alternating the
order of the modes).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as stdqueue
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import psycopg

from .config import ROOT, Ctx, log
from .listeners import cluster
from .scale import tree_cpu

COUNTS = (1, 50, 200)
MODES = ("direct", "relay", "pgbouncer", "pgbouncer_relay")
#: the peers, side by side: the same consumers and publisher on their own servers (no
#: server CPU: not this cluster's)
PEERS = ("rabbitmq", "redis")
MAX_CONNECTIONS = 100
BOUNCER_POOL = 40
#: seconds of each window
RATE_SECONDS = 8.0
LATENCY_SECONDS = 6.0
LATENCY_RATE = 200.0
QUEUE = "fleet"

FLEET_FIGURES: dict[str, tuple[str, str, str]] = {}
for _mode in MODES + PEERS:
    for _n in COUNTS:
        FLEET_FIGURES[f"fleet_{_mode}_sessions_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: server sessions",
            "sessions",
            "lower",
        )
        FLEET_FIGURES[f"fleet_{_mode}_started_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: consumers that started",
            "consumers",
            "higher",
        )
        FLEET_FIGURES[f"fleet_{_mode}_rate_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: publish rate",
            "msg/s",
            "higher",
        )
        FLEET_FIGURES[f"fleet_{_mode}_p50_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: latency p50",
            "ms",
            "lower",
        )
        FLEET_FIGURES[f"fleet_{_mode}_p99_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: latency p99",
            "ms",
            "lower",
        )
        FLEET_FIGURES[f"fleet_{_mode}_cpu_{_n}"] = (
            f"Fleet {_mode}, {_n} idle consumers: server CPU per publish",
            "us",
            "lower",
        )


def _tests_on_path() -> None:
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def _consumer(url: str, options: dict[str, Any], ready: Any, stop: Any, out: Any) -> None:
    """One idle worker: consume QUEUE until ``stop``, reporting each delivery's latency."""
    from kombu import Connection, Consumer, Queue

    import kombu_pgqueue  # noqa: F401 - registers pgqueue://

    try:
        conn = Connection(url, transport_options=options)
        conn.connect()

        def on_message(body: Any, message: Any) -> None:
            if "t" in body:
                out.put(("latency", time.time() - body["t"]))
            message.ack()

        with Consumer(conn, [Queue(QUEUE)], callbacks=[on_message], prefetch_count=4):
            ready.put(("ready", os.getpid()))
            while not stop.is_set():
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    pass
        conn.release()
    except Exception as exc:  # noqa: BLE001 - counted as not started
        ready.put(("failed", f"{type(exc).__name__}: {exc}"[:200]))


def _publisher(url: str, options: dict[str, Any], seconds: float, rate: float, out: Any) -> None:
    """Publish to QUEUE for ``seconds``, as fast as it goes (rate 0) or at ``rate``."""
    from kombu import Connection, Producer

    import kombu_pgqueue  # noqa: F401

    try:
        with Connection(url, transport_options=options) as conn:
            producer = Producer(conn)
            producer.publish({"warm": True}, routing_key=QUEUE)
            n, start = 0, time.monotonic()
            end = start + seconds
            while (now := time.monotonic()) < end:
                producer.publish({"t": time.time()} if rate else {"n": n}, routing_key=QUEUE)
                n += 1
                if rate:
                    due = start + n / rate
                    if due > now:
                        time.sleep(due - now)
            out.put(("published", n, time.monotonic() - start))
    except Exception as exc:  # noqa: BLE001 - the row says it could not publish
        out.put(("failed", f"{type(exc).__name__}: {exc}"[:200], 0.0))


class Consumers:
    def __init__(self, url: str, options: dict[str, Any]) -> None:
        # forked from a process that imported Kombu once: 200 start in seconds
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["kombu", "kombu_pgqueue"])
        self.url, self.options = url, options
        self.ready = self.ctx.Queue()
        self.out = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.procs: list[Any] = []
        self.started = 0
        self.failures: list[str] = []

    def grow(self, n: int, batch: int = 10) -> None:
        """Start consumers until there are ``n``, ``batch`` at a time, each waited for."""
        while len(self.procs) < n:
            starting = min(batch, n - len(self.procs))
            for _ in range(starting):
                p = self.ctx.Process(
                    target=_consumer, args=(self.url, self.options, self.ready, self.stop, self.out)
                )
                p.start()
                self.procs.append(p)
            for _ in range(starting):
                kind, detail = self.ready.get(timeout=300)
                if kind == "ready":
                    self.started += 1
                else:
                    self.failures.append(str(detail))

    def latencies(self) -> list[float]:
        found = []
        while True:
            try:
                kind, value = self.out.get(timeout=0.5)
            except stdqueue.Empty:
                return found
            if kind == "latency":
                found.append(value)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _publish(url: str, options: dict[str, Any], seconds: float, rate: float) -> tuple[int, float]:
    """(published, seconds) of a publisher process; (0, 0) if it could not publish."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_publisher, args=(url, options, seconds, rate, out))
    p.start()
    kind, n, took = out.get(timeout=seconds + 120)
    p.join(timeout=30)
    if kind != "published":
        log(f"  fleet: the publisher could not publish: {n}")
        return 0, 0.0
    return n, took


def _wait_empty(url: str, options: dict[str, Any], timeout: float = 180.0) -> None:
    """Until QUEUE holds no ready message (the consumers took the rate window's), or
    ``timeout``."""
    from kombu import Connection, Queue

    try:
        with Connection(url, transport_options=options) as conn:
            queue = Queue(QUEUE).bind(conn.default_channel)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if queue.queue_declare(passive=True).message_count == 0:
                        return
                except conn.channel_errors:  # gone: nothing waits in it
                    return
                time.sleep(0.2)
            log(f"  fleet: {QUEUE} still held messages after {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - the row's latency says what came of it
        log(f"  fleet: could not look at {QUEUE}: {type(exc).__name__}: {exc}"[:200])


def _sessions(monitor: psycopg.Connection) -> int:
    """Client sessions of the cluster but ``monitor``'s (opened before the fleet: a full
    server would refuse it)."""
    row = monitor.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
        " AND pid <> pg_backend_pid()"
    ).fetchone()
    return int(row[0]) if row else 0


def _peer_connections(mode: str, url: str) -> int:
    """Client connections the peer's server holds now (RabbitMQ's ``rabbitmqctl
    list_connections``; Redis' ``INFO clients`` but the asking one); -1 when the harness
    cannot ask."""
    if mode == "rabbitmq":
        try:
            listed = subprocess.run(
                ["rabbitmqctl", "-q", "list_connections", "pid"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return -1
        return sum(1 for line in listed.stdout.splitlines() if line.strip().startswith("<"))
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("clients")["connected_clients"]) - 1
    finally:
        client.close()


def _server_cpu(datadir: str) -> float:
    with open(os.path.join(datadir, "postmaster.pid")) as f:
        return tree_cpu(int(f.readline()))


def _row(
    c: Any,
    connections: Any,
    url: str,
    options: dict[str, Any],
    consumers: Consumers,
    n: int,
) -> dict[str, float]:
    """One row's figures; ``c`` the cluster (None for a peer: no server CPU), and
    ``connections()`` the server's client sessions or connections."""
    consumers.grow(n)
    consumers.latencies()  # what came before
    figures: dict[str, float] = {
        "started": consumers.started,
        "sessions": connections(),
    }
    cpu0 = _server_cpu(c.datadir) if c is not None else 0.0
    published, took = _publish(url, options, RATE_SECONDS, 0.0)
    figures["rate"] = published / took if took else 0.0
    if c is not None:
        figures["cpu"] = (_server_cpu(c.datadir) - cpu0) / max(published, 1) * 1e6
    _wait_empty(url, options)  # a backlog the rate left would delay every latency message
    consumers.latencies()
    _publish(url, options, LATENCY_SECONDS, LATENCY_RATE)
    found = sorted(consumers.latencies())
    if found:
        figures["p50"] = statistics.median(found) * 1000
        figures["p99"] = found[min(len(found) - 1, int(0.99 * len(found)))] * 1000
    return figures


def bench_fleet(ctx: Ctx) -> dict[str, list[float]]:
    """The sweep, ``ctx.runs`` times; every figure a list of one value per run."""
    out: dict[str, list[float]] = {}
    with (
        cluster(MAX_CONNECTIONS, "bench-fleet") as c,
        psycopg.connect(c.dsn, autocommit=True) as monitor,
    ):
        for run in range(ctx.runs):
            every = MODES + PEERS
            for mode in every if run % 2 == 0 else tuple(reversed(every)):
                if mode in PEERS:
                    _peer_rows(ctx, mode, out)
                    continue
                with _target(c, mode) as url:
                    _mode_rows(ctx, c, monitor, mode, url, out)
    return out


@contextlib.contextmanager
def _target(c: Any, mode: str) -> Iterator[str]:
    """The URL of ``mode``: the cluster itself, or a PgBouncer of its own in front of it
    (a new one for each mode, so that one mode's load leaves the next nothing)."""
    if not mode.startswith("pgbouncer"):
        yield f"pgqueue://postgres@127.0.0.1:{c.port}/postgres"
        return
    _tests_on_path()
    from pgbouncer import PgBouncer

    with PgBouncer.start(c.dsn, pool_mode="transaction", pool_size=BOUNCER_POOL) as bouncer:
        yield f"pgqueue://postgres@127.0.0.1:{bouncer.port}/postgres"


def _mode_rows(
    ctx: Ctx, c: Any, monitor: psycopg.Connection, mode: str, url: str, out: dict[str, list[float]]
) -> None:
    schema = f"{ctx.prefix}_fleet_{mode}"
    options: dict[str, Any] = {"schema": schema, "polling_interval": 5.0}
    if mode.endswith("relay"):
        options["relay"] = True
    consumers = Consumers(url, options)
    try:
        for n in COUNTS:
            log(f"  fleet {mode}: {n} idle consumers")
            figures = _row(c, partial(_sessions, monitor), url, options, consumers, n)
            for key, value in figures.items():
                out.setdefault(f"fleet_{mode}_{key}_{n}", []).append(value)
        if consumers.failures:
            log(
                f"  fleet {mode}: {len(consumers.failures)} consumers could not start, "
                f"e.g. {consumers.failures[0]}"
            )
    finally:
        consumers.close()


def _peer_rows(ctx: Ctx, mode: str, out: dict[str, list[float]]) -> None:
    """The same sweep against a peer (``ctx.brokers``' URL for it), if it is available."""
    broker = ctx.brokers.get(mode)
    if broker is None or not broker.available:
        log(f"  fleet {mode}: not available")
        return
    url = broker.url
    before = _peer_connections(mode, url)
    consumers = Consumers(url, {})
    try:
        for n in COUNTS:
            log(f"  fleet {mode}: {n} idle consumers")
            figures = _row(None, partial(_peer_connections, mode, url), url, {}, consumers, n)
            figures["sessions"] -= before  # other clients of the shared server
            for key, value in figures.items():
                out.setdefault(f"fleet_{mode}_{key}_{n}", []).append(value)
    finally:
        consumers.close()
