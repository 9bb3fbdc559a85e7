"""The ``listeners`` group: what NOTIFY costs a publish when many workers listen.

Every consuming pgqueue transport (one per Celery worker, idle or not, whatever queues it
consumes) holds one connection that LISTENs on its schema's channel, and every publish
statement NOTIFYs that channel. PostgreSQL (15 here) takes a cluster-wide lock at the
commit of any transaction that notified, holds it across the WAL flush, and then signals
every backend of the database that LISTENs (on any channel), each of which wakes, reads
the notification queue and sends the notification to its client.

So an idle worker is represented here by exactly what it costs the server: one session
that LISTENs on the broker's channel (``kombu_pgqueue._options.notify_channel``) and
reads every notification it is sent, as a worker's listener does (a worker then drops
tokens of queues it does not consume, in Python, on its own machine). The listening
sessions are held by a few spawned processes, up to 125 sessions each, reading their
sockets with epoll.

The measurements run on a throwaway cluster of the benchmark's own (``tests/clusters.py``:
initdb into a temporary directory, another port, ``max_connections`` raised to 600; fsync
and synchronous_commit as PostgreSQL's defaults), so that nothing else listens there and
the shared server is left alone. For each count of listening sessions (1, 50, 200, 500),
one publisher process runs Kombu's ``Producer.publish`` (default exchange, the ``publish``
statement) for a window, once as shipped and once with the statement's ``pg_notify(...)``
replaced by NULL (``scale.strip_notify``: what "notify only when it can matter" would
give when nobody waits for the queue), alternating which goes first; the message table is
truncated between windows. Then 8 publisher processes, both ways, with 1 and 200
listening sessions (the cluster-wide lock is held across each commit's WAL flush); and
one publisher with 200 sessions that listen on another channel, which nobody notifies
(what one channel per queue would give: PostgreSQL 15 signals them all the same).

Server CPU per publish = CPU-seconds of the cluster's processes (the postmaster, its
children, and children reaped during the window) / publishes. Listener CPU per publish =
the listening processes' CPU (on this machine; in production it is on the workers'
machines). Listening counts go up in run 1, down in run 2, and so on, and every
notification a listener should have had is checked for.
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
#: sessions that listen on a channel nobody notifies (PostgreSQL 15 signals them all the same)
OTHER = 200
MAX_CONNECTIONS = 600

LISTENER_FIGURES: dict[str, tuple[str, str, str]] = {}
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_rate_{_n}"] = (f"Publish, {_n} listening", "msg/s", "higher")
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_rate_plain_{_n}"] = (
        f"Publish without NOTIFY, {_n} listening",
        "msg/s",
        "higher",
    )
LISTENER_FIGURES["lst_ratio_200"] = ("Publish rate, 200 listening / 1", "x", "higher")
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_cpu_{_n}"] = (f"Server CPU per publish, {_n} listening", "us", "lower")
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_cpu_plain_{_n}"] = (
        f"Server CPU per publish without NOTIFY, {_n} listening",
        "us",
        "lower",
    )
for _n in COUNTS:
    LISTENER_FIGURES[f"lst_client_{_n}"] = (
        f"Listeners' CPU per publish, {_n} listening",
        "us",
        "lower",
    )
for _n in MANY_AT:
    LISTENER_FIGURES[f"lst_many_{_n}"] = (
        f"Publish, {MANY} processes, {_n} listening",
        "msg/s",
        "higher",
    )
    LISTENER_FIGURES[f"lst_many_plain_{_n}"] = (
        f"Publish without NOTIFY, {MANY} processes, {_n} listening",
        "msg/s",
        "higher",
    )
LISTENER_FIGURES[f"lst_other_{OTHER}"] = (
    f"Publish, {OTHER} listening on another channel",
    "msg/s",
    "higher",
)
LISTENER_FIGURES[f"lst_cpu_other_{OTHER}"] = (
    f"Server CPU per publish, {OTHER} listening on another channel",
    "us",
    "lower",
)


# -- the cluster -------------------------------------------------------------------------------


@contextlib.contextmanager
def cluster() -> Iterator[Any]:
    """A throwaway PostgreSQL with max_connections raised, removed on exit."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from clusters import Cluster
    finally:
        sys.path.remove(os.path.join(ROOT, "tests"))
    with Cluster.primary(name="bench-listeners") as c:
        with c.connect() as conn:
            conn.execute(f"ALTER SYSTEM SET max_connections = {MAX_CONNECTIONS}")
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
        conn.execute(sql.SQL("TRUNCATE {}.message").format(sql.Identifier(schema)))
        conn.execute("CHECKPOINT")


def _measure(
    c: Any, fleet: Fleet, lst: Listeners, seconds: float, notify: bool, schema: str
) -> tuple[Window, float, float, int]:
    """One window: (what the fleet did, server CPU-s, listeners' CPU-s, missed notifications)."""
    from kombu_pgqueue._options import notify_channel

    fleet_channel = notify_channel(schema)
    _truncate(c.dsn, schema)
    had = lst.received()
    cpu0, client0 = server_cpu(str(c.datadir)), proc_cpu(lst.pids())
    w = fleet.run(seconds, notify)
    cpu1, client1 = server_cpu(str(c.datadir)), proc_cpu(lst.pids())
    missed = 0
    if notify and lst.channel == fleet_channel:
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
                    for notify in order:
                        w, cpu, client, missed = _measure(c, one, lst, seconds, notify, schema)
                        tag = "" if notify else "plain_"
                        put(f"lst_rate_{tag}{n}", w.rate)
                        put(f"lst_cpu_{tag}{n}", cpu / w.published * 1e6)
                        if notify:
                            put(f"lst_client_{n}", client / w.published * 1e6)
                            if missed:
                                ctx.problem(
                                    "pgqueue",
                                    "listeners",
                                    f"{missed} notifications never reached {n} listeners",
                                )
                        log(
                            f"    {n:3d} listening, {'NOTIFY' if notify else 'plain '}: "
                            f"{w.rate:7.0f} msg/s, server {cpu / w.published * 1e6:6.0f} us, "
                            f"listeners {client / w.published * 1e6:6.0f} us per publish"
                        )
                    if n in MANY_AT:
                        for notify in order:
                            w, cpu, _, _ = _measure(c, many, lst, seconds, notify, schema)
                            tag = "" if notify else "plain_"
                            put(f"lst_many_{tag}{n}", w.rate)
                            log(
                                f"    {n:3d} listening, {MANY} publishers, "
                                f"{'NOTIFY' if notify else 'plain '}: {w.rate:7.0f} msg/s, "
                                f"server {cpu / w.published * 1e6:6.0f} us per publish"
                            )
                put("lst_ratio_200", out["lst_rate_200"][-1] / out["lst_rate_1"][-1])
                # the same sessions on a channel of their own: what per-queue channels give
                lst.resize(0)
                other = Listeners(c.dsn, f"{schema}_other.notify")
                try:
                    other.resize(OTHER)
                    w, cpu, _, _ = _measure(c, one, other, seconds, True, schema)
                finally:
                    other.close()
                put(f"lst_other_{OTHER}", w.rate)
                put(f"lst_cpu_other_{OTHER}", cpu / w.published * 1e6)
                log(
                    f"    {OTHER} listening on another channel, NOTIFY: {w.rate:7.0f} msg/s, "
                    f"server {cpu / w.published * 1e6:6.0f} us per publish"
                )
        finally:
            one.close()
            if many is not None:
                many.close()
            lst.close()
    return out
