"""The ``listeners`` group: what NOTIFY costs a publish when many workers listen.

Every consuming pgqueue transport (one per Celery worker, idle or not, whatever queues it
consumes) holds one connection that LISTENs on its schema's channel. A publish NOTIFYs
that channel only when a consumer waits for its queue (the consumer's listening session
*watches* it: an advisory lock, see the top of ``kombu_pgqueue/sql/queries.sql``; a
consumer with a backlog stops watching until it has drained the queue). PostgreSQL (15
here) takes a cluster-wide lock at the commit of any transaction that notified, holds it
across the WAL flush, and then signals every backend of the database that LISTENs (on
any channel), each of which wakes, reads the notification queue and sends the
notification to its client.

So an idle worker is represented here by exactly what it costs the server: one session
that LISTENs on the broker's channel (``kombu_pgqueue._options.notify_channel``) and
reads every notification it is sent, as a worker's listener does (a worker then drops
tokens of queues it does not consume, in Python, on its own machine). The listening
sessions are held by a few spawned processes, up to 125 sessions each, reading their
sockets with epoll. Two cases for each count of listening sessions:

- *none waiting*: no consumer watches the queue published to (the workers consume other
  queues, or are busy with a backlog of this one): the publishes send no NOTIFY;
- *waiting*: a consumer waits for the queue (a ``kombu_pgqueue._listener.Listener`` that
  watches it, one more listening session): every publish notifies, and PostgreSQL 15
  signals every listening session.

The measurements run on a throwaway cluster of the benchmark's own (``tests/clusters.py``:
initdb into a temporary directory, another port, ``max_connections`` raised to 600; fsync
and synchronous_commit as PostgreSQL's defaults), so that nothing else listens there and
the shared server is left alone. For each count of listening sessions (1, 50, 200, 500),
one publisher process runs Kombu's ``Producer.publish`` (default exchange, the ``publish``
statement) for a window in each case, alternating which goes first; the message table is
truncated between windows. Then 8 publisher processes, both cases, with 1 and 200
listening sessions (the cluster-wide lock is held across each notifying commit's WAL
flush, so notifying commits cannot share a flush).

Server CPU per publish = CPU-seconds of the cluster's processes (the postmaster, its
children, and children reaped during the window) / publishes. Listener CPU per publish =
the listening processes' CPU (on this machine; in production it is on the workers'
machines). Listening counts go up in run 1, down in run 2, and so on, and when a
consumer waits, every notification a listener should have had is checked for.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from .config import ROOT, Ctx, log
from .scale import Fleet, Window, proc_cpu, tree_cpu, window

#: listening sessions measured, and how they are split among processes
COUNTS = (1, 50, 200, 500)
CHUNKS = (1, 49, 75, 75, 100, 100, 100)  # cumulative: 1, 50, 125, 200, 300, 400, 500
#: listening sessions with which 8 publishers are measured
MANY_AT = (1, 200)
MANY = 8
MAX_CONNECTIONS = 600

LISTENER_FIGURES: dict[str, tuple[str, str, str]] = {}
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_rate_{_n}"] = (
        f"Publish, {_n} listening, none waiting",
        "msg/s",
        "higher",
    )
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_rate_waiting_{_n}"] = (
        f"Publish, {_n} listening, a consumer waiting",
        "msg/s",
        "higher",
    )
LISTENER_FIGURES["lst_ratio_200"] = ("Publish rate, 200 listening / 1, none waiting", "x", "higher")
LISTENER_FIGURES["lst_ratio_waiting_200"] = (
    "Publish rate, 200 listening / 1, a consumer waiting",
    "x",
    "higher",
)
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_cpu_{_n}"] = (
        f"Server CPU per publish, {_n} listening, none waiting",
        "us",
        "lower",
    )
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_cpu_waiting_{_n}"] = (
        f"Server CPU per publish, {_n} listening, a consumer waiting",
        "us",
        "lower",
    )
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_client_waiting_{_n}"] = (
        f"Listeners' CPU per publish, {_n} listening, a consumer waiting",
        "us",
        "lower",
    )
for _n in MANY_AT:
    LISTENER_FIGURES[f"lst_many_{_n}"] = (
        f"Publish, {MANY} processes, {_n} listening, none waiting",
        "msg/s",
        "higher",
    )
    LISTENER_FIGURES[f"lst_many_waiting_{_n}"] = (
        f"Publish, {MANY} processes, {_n} listening, a consumer waiting",
        "msg/s",
        "higher",
    )


# -- the cluster -------------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(max_connections: int = MAX_CONNECTIONS, name: str = "bench-listeners") -> Iterator[Any]:
    """A throwaway PostgreSQL with ``max_connections`` (raised, by default), removed on
    exit."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from clusters import Cluster
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    with Cluster.primary(name=name) as c:
        with c.connect() as conn:
            conn.execute(f"ALTER SYSTEM SET max_connections = {max_connections}")
        c.stop()
        c.start()
        yield c


def server_cpu(datadir: str) -> float:
    """CPU-seconds of the cluster: the postmaster (with its reaped children) and its live
    children."""
    with open(os.path.join(datadir, "postmaster.pid")) as f:
        return tree_cpu(int(f.readline()))


# -- listening sessions ------------------------------------------------------------------------


def _listen(dsn: str, channel: str, n: int, ready: Any, stop: Any, received: Any) -> None:
    """Hold ``n`` sessions that LISTEN on ``channel``; count what they are sent."""
    import selectors

    conns = []
    sel = selectors.DefaultSelector()
    listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel))
    for _ in range(n):
        conn = psycopg.connect(dsn, autocommit=True)
        conn.execute(listen)
        conn.pgconn.nonblocking = 1
        sel.register(conn.fileno(), selectors.EVENT_READ, conn.pgconn)
        conns.append(conn)
    ready.set()
    count = 0
    while not stop.is_set():
        for key, _ in sel.select(timeout=0.2):
            pgconn = key.data
            pgconn.consume_input()
            while pgconn.notifies() is not None:
                count += 1
        received.value = count
    for conn in conns:
        conn.close()


class Listeners:
    """Listening sessions held by spawned processes, added and removed a chunk at a time."""

    def __init__(self, dsn: str, channel: str) -> None:
        self.dsn = dsn
        self.channel = channel
        self.spawn = mp.get_context("spawn")
        self.held: list[tuple[Any, Any, Any, int]] = []  # (process, stop, received, n)

    @property
    def count(self) -> int:
        return sum(h[3] for h in self.held)

    def pids(self) -> list[int]:
        return [h[0].pid for h in self.held]

    def received(self) -> int:
        return sum(h[2].value for h in self.held)

    def resize(self, target: int) -> None:
        while self.count > target:
            proc, stop, _, _ = self.held.pop()
            stop.set()
            proc.join(30)
        while self.count < target:
            n = CHUNKS[len(self.held)]
            ready, stop = self.spawn.Event(), self.spawn.Event()
            received = self.spawn.Value("q", 0, lock=False)
            proc = self.spawn.Process(
                target=_listen,
                args=(self.dsn, self.channel, n, ready, stop, received),
                daemon=True,
            )
            proc.start()
            if not ready.wait(120):
                raise RuntimeError(f"{n} listening sessions not open within 120 s")
            self.held.append((proc, stop, received, n))
        assert self.count == target, (self.count, target)

    def close(self) -> None:
        self.resize(0)


# -- the sweep ---------------------------------------------------------------------------------


def _truncate(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {}.message_store").format(sql.Identifier(schema)))
        conn.execute("CHECKPOINT")


@contextlib.contextmanager
def _waiting(dsn: str, schema: str, queue: str, waiting: bool) -> Iterator[None]:
    """A consumer that waits for ``queue`` (its listening session watches it), if
    ``waiting``."""
    if not waiting:
        yield
        return
    from kombu_pgqueue._listener import Listener
    from kombu_pgqueue._options import parse_options

    listener = Listener(dsn, parse_options({"schema": schema}))
    listener.open()
    listener.watch([queue])
    try:
        yield
    finally:
        listener.close()


def _measure(
    c: Any, fleet: Fleet, lst: Listeners, seconds: float, waiting: bool, schema: str, queue: str
) -> tuple[Window, float, float, int]:
    """One window: (what the fleet did, server CPU-s, listeners' CPU-s, missed notifications)."""
    _truncate(c.dsn, schema)
    with _waiting(c.dsn, schema, queue, waiting):
        had = lst.received()
        cpu0, client0 = server_cpu(str(c.datadir)), proc_cpu(lst.pids())
        w = fleet.run(seconds)
        cpu1, client1 = server_cpu(str(c.datadir)), proc_cpu(lst.pids())
    missed = 0
    if waiting:
        # the listeners may lag the publishers: give them a moment to read what was sent
        want = had + lst.count * (w.published + 20 * len(fleet.procs))
        deadline = time.monotonic() + 10
        while lst.received() < want and time.monotonic() < deadline:
            time.sleep(0.05)
        missed = max(0, want - lst.received())
    return w, cpu1 - cpu0, client1 - client0, missed


def bench_listeners(ctx: Ctx) -> dict[str, list[float]]:
    """The sweep, ``ctx.runs`` times; every figure a list of one value per run."""
    from kombu_pgqueue._options import notify_channel

    seconds = window(ctx)
    schema = f"{ctx.prefix}_lst"
    queue = f"{ctx.prefix}_lst"
    out: dict[str, list[float]] = {}
    options = {"schema": schema}

    def put(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    with cluster() as c:
        url = f"pgqueue://postgres@127.0.0.1:{c.port}/postgres"
        lst = Listeners(c.dsn, notify_channel(schema))
        one = Fleet(url, options, queue, 1, "kombu")
        many: Fleet | None = None
        try:
            one.run(0.5)  # installs the schema; warms the server
            many = Fleet(url, options, queue, MANY, "kombu")
            for run in range(ctx.runs):
                counts = COUNTS if run % 2 == 0 else tuple(reversed(COUNTS))
                for n in counts:
                    lst.resize(n)
                    order = (True, False) if (run + counts.index(n)) % 2 == 0 else (False, True)
                    for waiting in order:
                        w, cpu, client, missed = _measure(
                            c, one, lst, seconds, waiting, schema, queue
                        )
                        tag = "waiting_" if waiting else ""
                        put(f"lst_rate_{tag}{n}", w.rate)
                        put(f"lst_cpu_{tag}{n}", cpu / w.published * 1e6)
                        if waiting:
                            put(f"lst_client_waiting_{n}", client / w.published * 1e6)
                            if missed:
                                ctx.problem(
                                    "pgqueue",
                                    "listeners",
                                    f"{missed} notifications never reached {n} listeners",
                                )
                        log(
                            f"    {n:3d} listening, {'waiting' if waiting else 'none   '}: "
                            f"{w.rate:7.0f} msg/s, server {cpu / w.published * 1e6:6.0f} us, "
                            f"listeners {client / w.published * 1e6:6.0f} us per publish"
                        )
                    if n in MANY_AT:
                        for waiting in order:
                            w, cpu, _, _ = _measure(c, many, lst, seconds, waiting, schema, queue)
                            tag = "waiting_" if waiting else ""
                            put(f"lst_many_{tag}{n}", w.rate)
                            log(
                                f"    {n:3d} listening, {MANY} publishers, "
                                f"{'waiting' if waiting else 'none   '}: {w.rate:7.0f} msg/s, "
                                f"server {cpu / w.published * 1e6:6.0f} us per publish"
                            )
                put("lst_ratio_200", out["lst_rate_200"][-1] / out["lst_rate_1"][-1])
                put(
                    "lst_ratio_waiting_200",
                    out["lst_rate_waiting_200"][-1] / out["lst_rate_waiting_1"][-1],
                )
        finally:
            one.close()
            if many is not None:
                many.close()
            lst.close()
    return out
