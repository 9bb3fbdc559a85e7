"""Publishing at scale: the ``publishers`` group (a web tier of 8 publisher processes) and
the registry of the scale groups (``publishers`` here, ``listeners`` in listeners.py).

``publishers``: 8 processes call ``apply_async`` of a no-op task as fast as they can for
a fixed window, every broker in turn (run 1 of every broker, then run 2, ...). The
processes start together (each warms up, then waits for the same go signal); the rate is
all their tasks over the span from the first start to the last end. The figure to read
is pgqueue against ``rabbitmq_confirm`` (publisher confirms: a publish returns once the
broker has the message, as a pgqueue publish returns once committed). On a 2-core machine
shared with other work the rates swing; the CPU per task that the publishers and the
broker's server spent in the window (from /proc: the publisher processes; PostgreSQL's
postmaster and all its children, RabbitMQ's beam.smp, redis-server) is steadier. The
server's CPU counts everything it did meanwhile, other sessions' work included.

:class:`Fleet` is the publishing side of both groups: long-lived processes that publish
on command, each window with or without the NOTIFY of pgqueue's publish statements
(:func:`strip_notify`, a what-if that swaps the statements in the process's own cache of
``kombu_pgqueue._sql``; the package itself is not changed).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import SIZES, Ctx
from .peers import Broker, declare, delete_queue

#: publisher processes of the ``publishers`` group (a web tier)
PUBLISHERS = 8
#: seconds each window publishes (full, --quick)
WINDOW = {"full": 5.0, "quick": 3.0}

# key -> (label, unit, better), as figures.FIGURES
PUBLISHER_FIGURES: dict[str, tuple[str, str, str]] = {
    "pub8_apply_async": (f"Celery apply_async, {PUBLISHERS} processes", "tasks/s", "higher"),
    "pub8_client_us": (f"  CPU per task, the {PUBLISHERS} publishers", "us", "lower"),
    "pub8_server_us": ("  CPU per task, the broker's server (all of it)", "us", "lower"),
}


def window(ctx: Ctx) -> float:
    quick = ctx.sizes["celery_n"] == SIZES["quick"]["celery_n"]
    return WINDOW["quick" if quick else "full"]


# -- what-if: publish statements without their NOTIFY --------------------------------------


def without_notify(text: str) -> str:
    """``text`` with each ``pg_notify(...)`` call replaced by NULL (the rest unchanged)."""
    while "pg_notify(" in text:
        start = text.index("pg_notify(")
        depth = 0
        for i in range(start + len("pg_notify"), len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:start] + "NULL" + text[i + 1 :]
                break
        else:
            raise ValueError("unbalanced pg_notify(")
    return text


_SWAPPED = ("publish", "publish_routed")


def strip_notify(schema: str, notify: bool) -> None:
    """Make this process's publishes to ``schema`` notify (as shipped) or not."""

    from kombu_pgqueue import _sql

    cache = _sql.queries(schema)  # the dict every Store of the schema reads
    raw = _sql.raw_queries()
    for name in _SWAPPED:
        text = raw[name] if notify else without_notify(raw[name])
        cache[name] = _sql.compose(text, schema)


# -- CPU from /proc ------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_cpu(pids: list[int]) -> float:
    """CPU-seconds of these processes."""
    total = 0
    for pid in pids:
        fields = _stat(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def tree_cpu(root: int) -> float:
    """CPU-seconds of ``root`` (with its reaped children) and of its live children."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(entry)
        if fields is None:
            continue
        if int(entry) == root:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        elif int(fields[1]) == root:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def server_meter(ctx: Ctx, broker: Broker) -> Callable[[], float] | None:
    """A reader of the CPU-seconds of the broker's server, if it runs on this machine."""
    if broker.name.startswith("pgqueue"):
        import psycopg

        with psycopg.connect(ctx.settings.dsn) as conn:
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        fields = _stat(backend)
        if fields is None:
            return None
        postmaster = int(fields[1])
        return lambda: tree_cpu(postmaster)
    comm = {"redis": "redis-server", "rabbitmq": "beam.smp"}.get(broker.name.split("_")[0])
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/comm") as f:
                if entry.isdigit() and f.read().strip() == comm:
                    pids.append(int(entry))
        except OSError:
            pass
    return (lambda: proc_cpu(pids)) if pids else None


# -- the publisher fleet ---------------------------------------------------------------------


def _publisher(
    url: str,
    options: dict[str, Any],
    queue: str,
    mode: str,
    commands: Any,
    replies: Any,
    go: Any,
) -> None:
    """One publisher process: on ("prep", notify) warm up and say ready; then publish
    from the go signal for the window; ("stop",) ends it."""
    import kombu_pgqueue  # noqa: F401 - registers pgqueue://

    from .bench_app import make_app
    from .config import SMALL_BODY

    pg = url.startswith("pgqueue")
    if mode == "celery":
        app = make_app(url, options, queue)
        task = app.tasks["bench.noop"]

        def call() -> None:
            task.apply_async()

    else:
        from kombu import Connection, Producer, Queue

        conn = Connection(url, transport_options=options)
        channel = conn.channel()
        Queue(queue, routing_key=queue)(channel).declare()
        producer = Producer(channel, serializer="json")

        def call() -> None:
            producer.publish(SMALL_BODY, routing_key=queue)

    while True:
        cmd = commands.get()
        if cmd[0] == "stop":
            break
        _, notify, seconds = cmd
        if pg:
            strip_notify(options["schema"], notify)
        for _ in range(20):  # connection, declarations, prepared statements
            call()
        replies.put(("ready",))
        go.wait()
        cpu0 = time.process_time()
        began = time.time()
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            call()
            n += 1
        replies.put(("done", n, began, time.time(), time.process_time() - cpu0))
    if mode == "celery":
        app.close()
    else:
        conn.release()


@dataclass
class Window:
    """What one window of a fleet did."""

    published: int
    seconds: float
    #: CPU-seconds of the publisher processes
    client_cpu: float
    #: CPU-seconds of the server, if a meter was given
    server_cpu: float | None = None

    @property
    def rate(self) -> float:
        return self.published / self.seconds


class Fleet:
    """``n`` publisher processes (spawned, so nothing of this process is inherited)."""

    def __init__(self, url: str, options: dict[str, Any], queue: str, n: int, mode: str) -> None:
        spawn = mp.get_context("spawn")
        self.replies = spawn.Queue()
        self.go = spawn.Event()
        self.commands = [spawn.Queue() for _ in range(n)]
        self.procs = [
            spawn.Process(
                target=_publisher,
                args=(url, options, queue, mode, c, self.replies, self.go),
                daemon=True,
            )
            for c in self.commands
        ]
        for p in self.procs:
            p.start()

    def _reply(self, timeout: float) -> tuple[Any, ...]:
        try:
            return self.replies.get(timeout=timeout)  # type: ignore[no-any-return]
        except Exception as exc:  # queue.Empty
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            raise RuntimeError(f"publisher fleet stalled (exit codes of the dead: {dead})") from exc

    def run(
        self, seconds: float, notify: bool = True, meter: Callable[[], float] | None = None
    ) -> Window:
        self.go.clear()
        for c in self.commands:
            c.put(("prep", notify, seconds))
        for _ in self.procs:
            self._reply(120.0)
        before = meter() if meter else 0.0
        self.go.set()
        done = [self._reply(seconds + 60.0) for _ in self.procs]
        after = meter() if meter else 0.0
        self.go.clear()
        return Window(
            published=sum(d[1] for d in done),
            seconds=max(d[3] for d in done) - min(d[2] for d in done),
            client_cpu=sum(d[4] for d in done),
            server_cpu=after - before if meter else None,
        )

    def close(self) -> None:
        for c in self.commands:
            c.put(("stop",))
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


# -- the publishers group ----------------------------------------------------------------------


def bench_publishers(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    """apply_async from PUBLISHERS processes at once for one window; tasks/s."""
    name = ctx.queue(broker, f"p{run}")
    declare(broker, name)
    meter = server_meter(ctx, broker)
    fleet = Fleet(broker.url, broker.options, name, PUBLISHERS, "celery")
    try:
        w = fleet.run(window(ctx), meter=meter)
    finally:
        fleet.close()
        delete_queue(broker, name)
    out = {"pub8_apply_async": w.rate, "pub8_client_us": w.client_cpu / w.published * 1e6}
    if w.server_cpu is not None:
        out["pub8_server_us"] = w.server_cpu / w.published * 1e6
    return out
