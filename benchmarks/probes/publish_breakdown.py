"""Where one ``apply_async`` goes, layer by layer, on several brokers interleaved.

    python benchmarks/probes/publish_breakdown.py timers [ROUNDS]
    python benchmarks/probes/publish_breakdown.py statements
    python benchmarks/probes/publish_breakdown.py pyspy BROKER

``timers``: the wall time and this process's CPU time (all threads) per call, then N
back-to-back ``apply_async`` of a no-op task (``PROBE_CALLS``, 3,000; the
harness' Celery settings, ``bench_app.make_app``) on each broker of :data:`BROKERS` in
turn, ROUNDS times (3), A/B/A/B. Each layer's entry point is wrapped with a timer, so
its inclusive time is known; the difference between a layer and the next one down is
the layer's own time:

    Celery       Task.apply_async            - kombu Producer.publish
    Kombu        Producer.publish            - the transport's Channel.basic_publish
    transport    pgqueue Channel.basic_publish - Store.rows (its codec.outgoing apart)
    store        Store.rows                 - psycopg Connection.execute (pool apart)
    psycopg      Connection.execute          - Connection.wait
    server       Connection.wait: from sending the statement to its result (network
                 round trip, execution, commit)

For RabbitMQ, ``amqp`` is ``amqp.Channel.basic_publish`` (the frame and socket write;
with confirms, ``basic_publish_confirm``, which also waits for the broker's ack).
A wrapper costs about 0.3 us per call; the totals are also given unwrapped.

``statements``: the server's side alone, on a dedicated psycopg connection (prepared,
autocommit): ``SELECT 1``, the ``publish`` and ``publish_routed`` statements as shipped
and without their ``pg_notify(...)``, with ``synchronous_commit`` off and on; medians
of N executions, interleaved.

``pyspy BROKER``: the same loop under ``py-spy record`` (1,000 samples/s, ``--idle``);
the 25 functions with the most samples on top of the stack (own time), and the share of
each library (as ``publish_profile.py``). Needs ``pip install py-spy``.

Brokers: ``pgqueue`` (durable), ``pgqueue_async`` (``synchronous_commit: "off"``),
``pgqueue_async_st0`` (the same with ``statement_timeout: 0``, so no client-side
deadline), ``rabbitmq`` (no confirms, Celery's default), ``rabbitmq_confirm``. Local servers; the
schema ``probe_bd`` is dropped first and last.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.peers import drop_schema  # noqa: E402 - after sys.path

N = int(os.environ.get("PROBE_CALLS", "3000"))
DSN = "host=127.0.0.1 dbname=test user=postgres"
SCHEMA = "probe_bd"
PG = "pgqueue://postgres@127.0.0.1:5432/test"
AMQP = "amqp://guest:guest@127.0.0.1:5672//"
BROKERS: dict[str, tuple[str, dict[str, Any]]] = {
    "pgqueue": (PG, {"schema": SCHEMA}),
    "pgqueue_async": (PG, {"schema": SCHEMA, "synchronous_commit": "off"}),
    # what-if: no client-side deadline (its watchdog thread is woken by every statement)
    "pgqueue_async_st0": (
        PG,
        {"schema": SCHEMA, "synchronous_commit": "off", "statement_timeout": 0},
    ),
    "rabbitmq": (AMQP, {}),
    "rabbitmq_confirm": (AMQP, {"confirm_publish": True}),
}


def make_task(name: str) -> Any:
    from benchmarks.bench_app import make_app

    url, options = BROKERS[name]
    app = make_app(url, options, f"probe_bd_{name}")
    return app.tasks["bench.noop"]


# -- timers ----------------------------------------------------------------------------------


class Timers:
    def __init__(self) -> None:
        self.total: collections.Counter[str] = collections.Counter()
        self.on = False

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        timers = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timers.on:
                return original(*args, **kwargs)
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.total[label] += time.perf_counter() - began

        setattr(owner, attr, timed)


def install(timers: Timers) -> None:
    import amqp.channel
    import celery.app.task
    import kombu.messaging
    import kombu.transport.pyamqp
    import psycopg
    import psycopg_pool

    import kombu_pgqueue._store
    import kombu_pgqueue.transport

    timers.wrap(celery.app.task.Task, "apply_async", "apply_async")
    timers.wrap(kombu.messaging.Producer, "publish", "producer")
    timers.wrap(kombu_pgqueue.transport.Channel, "basic_publish", "channel")
    timers.wrap(kombu.transport.pyamqp.Channel, "basic_publish", "channel")
    timers.wrap(kombu_pgqueue.transport.Channel, "_outgoing", "codec")
    timers.wrap(kombu_pgqueue._store.Store, "rows", "store")
    timers.wrap(psycopg_pool.ConnectionPool, "getconn", "pool")
    timers.wrap(psycopg_pool.ConnectionPool, "putconn", "pool")
    timers.wrap(psycopg.Connection, "execute", "execute")
    timers.wrap(psycopg.Connection, "wait", "server")
    # with confirms, amqp's channel sets basic_publish = basic_publish_confirm on itself
    timers.wrap(amqp.channel.Channel, "basic_publish_confirm", "channel")


def layers(t: collections.Counter[str], n: int) -> dict[str, float]:
    """Each layer's own microseconds per call."""
    us = {k: v / n * 1e6 for k, v in t.items()}
    out = {
        "total (wrapped)": us["apply_async"],
        "celery": us["apply_async"] - us["producer"],
        "kombu": us["producer"] - us["channel"],
    }
    if us.get("store"):
        out.update(
            {
                "transport (pgqueue Channel, codec apart)": us["channel"]
                - us["store"]
                - us["codec"],
                "codec.outgoing (message -> row, JSON)": us["codec"],
                "store (Store.rows, pool apart)": us["store"] - us["execute"] - us["pool"],
                "pool checkout + return": us["pool"],
                "psycopg (Python side)": us["execute"] - us["server"],
                "server (send -> result)": us["server"],
            }
        )
    else:
        out["amqp (frame, socket write; with confirms the broker's ack)"] = us["channel"]
    return out


def timers_main(rounds: int) -> None:
    drop_schema(DSN, SCHEMA)
    timers = Timers()
    install(timers)
    tasks = {name: make_task(name) for name in BROKERS}
    for task in tasks.values():
        for _ in range(50):  # connections, declarations, prepared statements
            task.apply_async()
    found: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    plain: dict[str, list[float]] = collections.defaultdict(list)
    cpus: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(rounds):
        names = list(tasks) if r % 2 == 0 else list(reversed(tasks))
        for name in names:
            task = tasks[name]
            began, cpu = time.perf_counter(), time.process_time()
            for _ in range(N):
                task.apply_async()
            plain[name].append((time.perf_counter() - began) / N * 1e6)
            cpus[name].append((time.process_time() - cpu) / N * 1e6)
            timers.total.clear()
            timers.on = True
            for _ in range(N):
                task.apply_async()
            timers.on = False
            found[name].append(layers(timers.total, N))
    for name in tasks:
        p, c = plain[name], cpus[name]
        print(
            f"\n{name}: unwrapped {statistics.median(p):.0f} us per apply_async "
            f"[{min(p):.0f}-{max(p):.0f}], of which this process's CPU "
            f"{statistics.median(c):.0f} us [{min(c):.0f}-{max(c):.0f}]; "
            f"{N} calls x {rounds} rounds"
        )
        for key in found[name][0]:
            vals = [f[key] for f in found[name]]
            print(
                f"  {key:<44} {statistics.median(vals):7.1f} us  [{min(vals):.1f}-{max(vals):.1f}]"
            )
    drop_schema(DSN, SCHEMA)


# -- statements -----------------------------------------------------------------------------


def statements_main() -> None:
    import psycopg

    import kombu_pgqueue  # noqa: F401 - registers pgqueue://
    from benchmarks.scale import without_notify
    from kombu_pgqueue import _sql
    from kombu_pgqueue._options import notify_channel
    from kombu_pgqueue.records import Outgoing

    drop_schema(DSN, SCHEMA)
    queue = "probe_bd_q"
    from kombu import Connection, Exchange, Queue

    with Connection(PG, transport_options={"schema": SCHEMA}) as kc:
        Queue(queue, Exchange(queue, "direct"), routing_key=queue)(kc.channel()).declare()
    raw = _sql.raw_queries()
    texts = {
        "SELECT 1": "SELECT 1",
        "publish": raw["publish"],
        "publish, no NOTIFY": without_notify(raw["publish"]),
        "publish_routed": raw["publish_routed"],
        "publish_routed, no NOTIFY": without_notify(raw["publish_routed"]),
    }
    message = Outgoing(
        queue=queue,
        body=b'{"id": 0, "payload": "' + b"x" * 64 + b'"}',
        headers="{}",
        properties="{}",
        content_type="application/json",
        content_encoding="utf-8",
    )
    # what Store.publish and publish_routed send, with gate false: the statement always
    # notifies (as inside an application's transaction), whether a consumer waits or not
    params = {
        **message.params(),
        "exchange": queue,
        "routing_key": queue,
        "replace": False,
        "channel": notify_channel(SCHEMA),
        "gate": False,
        "handoff": False,  # with gate false a publish hands nothing off
        "lease": 0,
    }
    results: dict[str, list[float]] = collections.defaultdict(list)
    with psycopg.connect(DSN, autocommit=True, prepare_threshold=0) as conn:
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET jit = off")
        composed = {k: _sql.compose(v, SCHEMA) for k, v in texts.items()}
        for rnd in range(4):
            for commit in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                conn.execute(f"SET synchronous_commit = {commit}")
                for name, q in composed.items():
                    for _ in range(50):
                        conn.execute(q, params)
                    samples = []
                    for _ in range(500):
                        began = time.perf_counter()
                        conn.execute(q, params)
                        samples.append(time.perf_counter() - began)
                    results[f"{name}, synchronous_commit={commit}"].append(
                        statistics.median(samples) * 1e6
                    )
            conn.execute(
                psycopg.sql.SQL("TRUNCATE {}.message_store").format(psycopg.sql.Identifier(SCHEMA))
            )
    print("median us per execution (client call, prepared), 4 rounds [min-max of rounds]")
    for key, vals in results.items():
        print(f"  {key:<52} {statistics.median(vals):7.1f}  [{min(vals):.1f}-{max(vals):.1f}]")
    drop_schema(DSN, SCHEMA)


# -- py-spy ---------------------------------------------------------------------------------

OWNERS = [
    ("server round trip (psycopg waits)", "psycopg/", {"Connection.wait", "wait_c", "wait"}),
    ("psycopg_pool", "psycopg_pool/", None),
    ("psycopg (Python side)", "psycopg/", None),
    ("kombu_pgqueue", "kombu_pgqueue/", None),
    ("amqp", "amqp/", None),
    ("kombu", "kombu/", None),
    ("celery", "celery/", None),
]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:]*):(?P<line>\d+)\)$")


def loop(name: str) -> None:
    task = make_task(name)
    for _ in range(50):
        task.apply_async()
    began = time.perf_counter()
    for _ in range(N):
        task.apply_async()
    print(f"{N} apply_async in {time.perf_counter() - began:.3f} s", flush=True)


def pyspy_main(name: str) -> None:
    drop_schema(DSN, SCHEMA)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "stacks.txt")
        proc = subprocess.run(
            ["py-spy", "record", "--idle", "--nonblocking", "-r", "1000", "-f", "raw"]
            + ["-o", raw, "--", sys.executable, __file__, "loop", name],
            check=False,
            capture_output=True,
            text=True,
        )
        done = next((x for x in proc.stdout.splitlines() if " apply_async in " in x), None)
        if done is None:
            raise SystemExit(f"py-spy run failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
        seconds = float(done.split(" in ")[1].split()[0])
        own: collections.Counter[str] = collections.Counter()
        libs: collections.Counter[str] = collections.Counter()
        for line in open(raw):
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if "Task.apply_async" not in stack:  # imports and set-up
                continue
            frames = stack.split(";")
            own[_short(frames[-1])] += int(n)
            libs[_owner(frames)] += int(n)
    drop_schema(DSN, SCHEMA)
    total = sum(own.values())
    per_call = seconds / N * 1e6
    print(f"{name}: {per_call:.0f} us per apply_async (under py-spy); {total} samples")
    print("  by library (innermost frame of a named library):")
    for lib, n in libs.most_common():
        print(f"    {lib:<40} {n / total:6.1%}  {per_call * n / total:6.1f} us")
    print("  top functions by own samples:")
    for func, n in own.most_common(25):
        print(f"    {n / total:6.1%}  {per_call * n / total:6.1f} us  {func}")


def _short(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{m['func']} ({path}:{m['line']})"


def _owner(frames: list[str]) -> str:
    for frame in reversed(frames):
        m = FRAME.match(frame)
        if not m:
            continue
        for bucket, fragment, funcs in OWNERS:
            if fragment in m["file"] and (funcs is None or m["func"] in funcs):
                return bucket
    return "other (stdlib called from the script)"


def main() -> None:
    import logging

    logging.getLogger("kombu_pgqueue").setLevel(logging.ERROR)
    cmd = sys.argv[1] if len(sys.argv) > 1 else "timers"
    commands: dict[str, Callable[[], None]] = {
        "timers": lambda: timers_main(int(sys.argv[2]) if len(sys.argv) > 2 else 3),
        "statements": statements_main,
        "pyspy": lambda: pyspy_main(sys.argv[2]),
        "loop": lambda: loop(sys.argv[2]),
    }
    commands[cmd]()


if __name__ == "__main__":
    main()
