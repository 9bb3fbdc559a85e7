"""Prometheus metrics: queue depths from the database, event counters from the process.

* ``celery -A proj pgqueue metrics --port 9808`` or ``python -m celery_pgqueue.metrics
  --dsn ... --port 9808``: an exporter of the queue gauges.
* ``install(app, port=9809)`` (or ``celery worker --pgqueue-metrics-port N`` after
  ``install(app)``): a worker bootstep serving the worker's counters, and with
  ``queues=True`` the gauges too. The consumer runs in the worker's main process
  whatever the pool, and so does the step. Every metric: ``docs/monitoring.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import click
from celery import bootsteps
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kombu_pgqueue import admin
from kombu_pgqueue.admin import DEFAULT_CAP, Generation, Monitor, QueueDepth, TableSize
from kombu_pgqueue.schedule import Entry, Leader

logger = logging.getLogger(__name__)

DEFAULT_PORT = 9808
#: at most one query set per this many seconds; scrapes in between share its result
DEFAULT_INTERVAL = 10.0

#: event (kombu_pgqueue.admin.COUNTER_EVENTS) -> metric name (without _total), help, by queue
COUNTERS = {
    "claimed": ("pgqueue_claimed", "Messages handed out by claims.", True),
    "empty_claims": ("pgqueue_empty_claims", "Claims that found nothing to hand out.", True),
    "handoffs": (
        "pgqueue_handoffs",
        "Messages a publish leased to a waiting consumer (no claim).",
        True,
    ),
    "handbacks": (
        "pgqueue_handbacks",
        "Handed-off messages the consumer could not take then, released at once.",
        True,
    ),
    "redelivered": ("pgqueue_redelivered", "Claimed messages delivered before.", True),
    "acked": ("pgqueue_acked", "Messages acked.", False),
    "requeued": ("pgqueue_requeued", "Messages rejected with requeue.", False),
    "rejected": ("pgqueue_rejected", "Messages rejected into the dead letters.", False),
    "renewed": ("pgqueue_lease_renewals", "Leases renewed by the lease keeper.", False),
    "lost_leases": ("pgqueue_lost_leases", "Renewals that found the lease gone.", False),
    "unroutable": (
        "pgqueue_unroutable",
        "Persistent messages no binding matched: dropped, lost.",
        False,
    ),
    "unroutable_transient": (
        "pgqueue_unroutable_transient",
        "Transient messages no binding matched (Celery's events with no monitor): dropped.",
        False,
    ),
    "publish_failed": (
        "pgqueue_publish_failed",
        "Unconfirmed publishes the server refused (logged).",
        False,
    ),
    "publish_lost": (
        "pgqueue_publish_lost",
        "Unconfirmed publishes in flight on a connection that broke (logged).",
        False,
    ),
}


#: the events counted by queue
_BY_QUEUE = frozenset(event for event, (_, _, by_queue) in COUNTERS.items() if by_queue)


def _gauge(name: str, help_text: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=list(labels))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One query set's result, shared by the scrapes of one refresh interval."""

    ok: bool
    seconds: float
    taken: float
    depths: list[QueueDepth]
    tables: list[TableSize]
    generations: list[Generation]
    periodic: list[Entry] = field(default_factory=list)
    leader: Leader | None = None


def _storage(generations: list[Generation]) -> Iterator[Metric]:
    """The storage's rotation: how many generations in each state, and the space that a
    lock holder (a pg_dump) keeps from being given back, and since when."""
    states = _gauge("pgqueue_generations", "Generations of the message storage.", "state")
    counted = {state: 0 for state in ("next", "current", "live", "drained", "emptied")}
    for generation in generations:
        counted[generation.state] = counted.get(generation.state, 0) + 1
    for state, count in counted.items():
        states.add_metric([state], count)
    waiting = [g for g in generations if g.waiting]
    space = _gauge(
        "pgqueue_storage_waiting_bytes",
        "Bytes of generations that hold nothing live, kept by a session's lock (pg_dump).",
    )
    space.add_metric([], float(sum(g.total_bytes for g in waiting)))
    held = _gauge(
        "pgqueue_storage_waiting_seconds",
        "Seconds the longest of those waits has lasted; 0 if none waits.",
    )
    held.add_metric([], max((g.blocked_seconds or 0.0 for g in waiting), default=0.0))
    yield from (states, space, held)


def _beat(entries: list[Entry], leader: Leader | None) -> Iterator[Metric]:
    """celery_pgqueue.beat: whether a beat leads (and which), and each entry's sends,
    late ones apart (later than the sending beat's pgqueue_beat_late_after)."""
    leading = _gauge("pgqueue_beat_leading", "1 if a beat leads (sends periodic tasks).")
    leading.add_metric([], 0.0 if leader is None else 1.0)
    which = _gauge("pgqueue_beat_leader", "1 for the node of the leading beat.", "node")
    if leader is not None:
        which.add_metric([leader.node], 1.0)
    yield from (leading, which)
    if not entries:
        return
    sends = CounterMetricFamily(
        "pgqueue_beat_sends", "Due times of a periodic entry sent.", labels=["entry"]
    )
    late = CounterMetricFamily(
        "pgqueue_beat_late_sends",
        "Due times of a periodic entry sent later than pgqueue_beat_late_after.",
        labels=["entry"],
    )
    lateness = _gauge(
        "pgqueue_beat_last_lateness_seconds",
        "Seconds between the last send of a periodic entry and its due time.",
        "entry",
    )
    for entry in entries:
        sends.add_metric([entry.name], entry.total_run_count)
        late.add_metric([entry.name], entry.late_count)
        lateness.add_metric([entry.name], entry.last_lateness or 0.0)
    yield from (sends, late, lateness)


class PgQueueCollector(Collector):
    """Queue gauges from ``monitor`` (if given) and this process's event counters; with
    ``running`` (a worker's), the number of tasks it runs now.

    The database is asked at most once per ``min_interval`` seconds, however often and
    from however many threads it is scraped.
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        *,
        counters: bool = True,
        min_interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        running: Callable[[], int] | None = None,
    ) -> None:
        self.monitor = monitor
        self.counters = counters
        self.running = running
        self.min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Snapshot | None = None

    def describe(self) -> list[Metric]:
        return []  # nothing: registering must not query the database

    def snapshot(self) -> Snapshot:
        """The cached query set, refreshed first when older than ``min_interval``."""
        assert self.monitor is not None
        with self._lock:
            last = self._last
            if last is not None and self._clock() - last.taken < self.min_interval:
                return last
            started = self._clock()
            try:
                depths = self.monitor.queue_depths()
                tables = self.monitor.table_sizes()
                generations = self.monitor.generations()
                periodic = self.monitor.periodic_entries()
                leader = self.monitor.beat_leader()
            except Exception as exc:  # the database may be down: say so, serve counters
                logger.warning("pgqueue metrics: monitoring queries failed: %r", exc)
                self._last = Snapshot(False, self._clock() - started, started, [], [], [])
            else:
                self._last = Snapshot(
                    True,
                    self._clock() - started,
                    started,
                    depths,
                    tables,
                    generations,
                    periodic,
                    leader,
                )
            return self._last

    def collect(self) -> Iterator[Metric]:
        if self.monitor is not None:
            yield from self._gauges(self.snapshot())
        if self.counters:
            yield from self._counters()
        if self.running is not None:
            # under early acks (Celery's default) a running task's message is gone: the
            # queue's "leased" misses it, and only the worker knows
            running = _gauge(
                "pgqueue_worker_tasks_running",
                "Tasks this worker runs now, whether their message was acked or not.",
            )
            running.add_metric([], float(self.running()))
            yield running

    def _gauges(self, snap: Snapshot) -> Iterator[Metric]:
        assert self.monitor is not None
        up = _gauge("pgqueue_up", "1 if the last monitoring queries succeeded.", "schema")
        up.add_metric([self.monitor.schema], 1.0 if snap.ok else 0.0)
        took = _gauge("pgqueue_monitor_query_seconds", "Duration of the last query set.")
        took.add_metric([], snap.seconds)
        yield from (up, took)
        messages = _gauge(
            "pgqueue_queue_messages", "Messages by queue and state.", "queue", "state"
        )
        exact = _gauge(
            "pgqueue_queue_messages_exact",
            "1 if pgqueue_queue_messages is an exact count, 0 if an estimate (above the cap).",
            "queue",
            "state",
        )
        oldest = _gauge(
            "pgqueue_queue_oldest_ready_age_seconds",
            "Seconds since the oldest ready message was published; 0 if none is ready.",
            "queue",
        )
        for depth in snap.depths:
            for state, count in depth.counts.items():
                messages.add_metric([depth.queue, state], count)
                exact.add_metric([depth.queue, state], 1.0 if depth.exact[state] else 0.0)
            oldest.add_metric([depth.queue], depth.oldest_ready_age or 0.0)
        yield from (messages, exact, oldest)
        size = _gauge("pgqueue_table_size_bytes", "Table size with indexes and TOAST.", "table")
        live = _gauge("pgqueue_table_live_rows", "Live rows as the server counts them.", "table")
        dead = _gauge("pgqueue_table_dead_rows", "Dead rows not yet vacuumed.", "table")
        for table in snap.tables:
            size.add_metric([table.table], table.total_bytes)
            live.add_metric([table.table], table.live_rows)
            dead.add_metric([table.table], table.dead_rows)
        yield from (size, live, dead)
        yield from _storage(snap.generations)
        yield from _beat(snap.periodic, snap.leader)

    def _counters(self) -> Iterator[Metric]:
        counts = admin.counters()
        # every queue this process consumed from (a claim, empty or not, or a handoff: a
        # queue served only by handoff claims nothing) gets every per-queue counter, 0
        # included
        queues = sorted({queue for (event, queue) in counts if event in _BY_QUEUE})
        for event, (name, help_text, by_queue) in COUNTERS.items():
            family = CounterMetricFamily(name, help_text, labels=["queue"] if by_queue else [])
            if by_queue:
                for queue in queues:
                    family.add_metric([queue], counts.get((event, queue), 0))
            else:
                family.add_metric([], sum(v for (e, _), v in counts.items() if e == event))
            yield family


_served: weakref.WeakSet[WSGIServer] = weakref.WeakSet()


def _close_in_child() -> None:
    # a forked pool process must not keep the listening socket open: the port would
    # stay taken after the worker stopped serving it
    for server in list(_served):
        server.socket.close()


os.register_at_fork(after_in_child=_close_in_child)


def serve(collector: Collector, port: int, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve ``collector`` alone at ``http://addr:port/metrics`` from a daemon thread.

    Port 0 picks a free port: read it from ``server.server_address[1]``.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr, registry=registry)
    _served.add(server)
    return server


def serve_forever(monitor: Monitor, port: int, addr: str, min_interval: float) -> None:
    """The exporter: queue gauges only (an exporter's own counters would stay at 0)."""
    collector = PgQueueCollector(monitor, counters=False, min_interval=min_interval)
    server = serve(collector, port, addr)
    print(
        f"pgqueue metrics for schema {monitor.schema!r} on "
        f"http://{addr}:{server.server_address[1]}/metrics",
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


def _running_tasks() -> int:
    """Tasks the worker runs now: Celery's own record, kept in the worker's main process
    from a task's start to its end whatever the pool and however it is acked."""
    from celery.worker import state

    return len(state.active_requests)


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """Worker bootstep: serves this worker's metrics while it runs (see :func:`install`)."""

    label = "pgqueue metrics"

    def __init__(self, parent: Any, pgqueue_metrics_port: int | None = None, **kwargs: Any):
        super().__init__(parent, **kwargs)
        conf = parent.app.conf
        port = conf.get("pgqueue_metrics_port")
        self.port = pgqueue_metrics_port if pgqueue_metrics_port is not None else port
        self.addr = conf.get("pgqueue_metrics_addr") or "0.0.0.0"
        self.queues = bool(conf.get("pgqueue_metrics_queues"))
        self.min_interval = float(conf.get("pgqueue_metrics_interval") or DEFAULT_INTERVAL)
        self.server: WSGIServer | None = None

    def include_if(self, parent: Any) -> bool:
        return self.port is not None

    def start(self, parent: Any) -> None:
        monitor = None
        if self.queues:
            connection = parent.app.connection_for_read()
            try:
                monitor = admin.Broker.from_connection(connection).monitor()
            finally:
                connection.release()
        collector = PgQueueCollector(
            monitor, min_interval=self.min_interval, running=_running_tasks
        )
        try:
            self.server = serve(collector, int(self.port), self.addr)
        except OSError as exc:  # a busy port must not keep the worker from working
            logger.error("pgqueue metrics: cannot serve on %s:%s: %s", self.addr, self.port, exc)
            return
        logger.info(
            "pgqueue metrics on http://%s:%d/metrics", self.addr, self.server.server_address[1]
        )

    def stop(self, parent: Any) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    terminate = stop


def install(
    app: Any,
    port: int | None = None,
    *,
    addr: str = "0.0.0.0",
    queues: bool = False,
    min_interval: float = DEFAULT_INTERVAL,
) -> None:
    """Let ``app``'s workers serve metrics on ``port`` or ``--pgqueue-metrics-port``.

    Without either the step stays out. ``queues=True`` adds the queue gauges (each
    worker then queries the database; one exporter is usually enough).
    """
    app.conf.update(
        pgqueue_metrics_addr=addr,
        pgqueue_metrics_queues=queues,
        pgqueue_metrics_interval=min_interval,
    )
    if port is not None:
        app.conf.pgqueue_metrics_port = port
    app.steps["worker"].add(MetricsStep)
    options = app.user_options["worker"]
    if not any("--pgqueue-metrics-port" in option.opts for option in options):
        help_text = "Serve pgqueue's Prometheus metrics on this port (0: a free one)."
        options.add(click.Option(["--pgqueue-metrics-port"], type=int, help=help_text))


def main(argv: list[str] | None = None) -> None:
    """``python -m celery_pgqueue.metrics --dsn ... [--schema pgqueue] [--port 9808]``."""
    parser = argparse.ArgumentParser(prog="python -m celery_pgqueue.metrics", description=__doc__)
    parser.add_argument("--dsn", required=True, help="libpq DSN or postgresql:// URL")
    parser.add_argument("--schema", default="pgqueue")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--addr", default="0.0.0.0")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL)
    parser.add_argument("--cap", type=int, default=DEFAULT_CAP)
    args = parser.parse_args(argv)
    # a monitor never installs or upgrades the schema: it reports pgqueue_up 0 until it exists
    broker = admin.Broker(args.dsn, schema=args.schema, auto_migrate=False, pool_max_size=2)
    monitor = broker.monitor(cap=args.cap)
    serve_forever(monitor, args.port, args.addr, args.interval)


if __name__ == "__main__":
    main()
