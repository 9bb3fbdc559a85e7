"""What one round trip to a sleeping process costs, against one to a busy one.

    python benchmarks/probes/cold_wake.py [N]

The latency benchmark sends a task to an idle worker every ~50 ms, so every process
on the message's way is asleep when it arrives and must be woken. This measures one
round trip to a server, back to back ("warm") and after 20 ms of idle ("cold"), p50
of N (300) each, interleaved by round:

    pipe           a child Python process echoing over a pipe: the machine's own cost
                   of waking a process and being woken
    PostgreSQL     ``SELECT 1`` on a psycopg connection (the shared server)
    RabbitMQ       a passive ``queue_declare`` (one AMQP method and its answer)
    Redis          ``PING``

The difference cold - warm is what each hop of a path costs an idle worker's latency.
A handoff goes publisher -> its backend -> the worker's listening backend (woken by
the NOTIFY's signal) -> the worker: one process more than RabbitMQ's publisher ->
broker -> worker.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable

IDLE = 0.020
_sleep = threading.Event()


def _echo(conn: mp.connection.Connection) -> None:
    while True:
        got = conn.recv_bytes()
        if not got:
            return
        conn.send_bytes(got)


def _pipe() -> tuple[Callable[[], None], Callable[[], None]]:
    parent, child = mp.Pipe()
    proc = mp.Process(target=_echo, args=(child,), daemon=True)
    proc.start()

    def trip() -> None:
        parent.send_bytes(b"x")
        parent.recv_bytes()

    def close() -> None:
        parent.send_bytes(b"")
        proc.join(5)

    return trip, close


def _postgres() -> tuple[Callable[[], None], Callable[[], None]]:
    import psycopg

    conn = psycopg.connect("host=127.0.0.1 dbname=test user=postgres", autocommit=True)
    return (lambda: conn.execute("SELECT 1").fetchone()), conn.close


def _rabbitmq() -> tuple[Callable[[], None], Callable[[], None]]:
    import amqp

    conn = amqp.Connection("127.0.0.1:5672", userid="guest", password="guest")
    conn.connect()
    channel = conn.channel()
    channel.queue_declare("probe_cold_wake", auto_delete=True)
    return (lambda: channel.queue_declare("probe_cold_wake", passive=True)), conn.close


def _redis() -> tuple[Callable[[], None], Callable[[], None]]:
    import redis

    client = redis.Redis("127.0.0.1", 6379)
    return client.ping, client.close


def _p50(trip: Callable[[], None], n: int, idle: float) -> float:
    for _ in range(20):
        trip()
    samples = []
    for _ in range(n):
        if idle:
            _sleep.wait(idle)
        began = time.perf_counter()
        trip()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    servers = {"pipe": _pipe, "PostgreSQL": _postgres, "RabbitMQ": _rabbitmq, "Redis": _redis}
    opened = {name: open_() for name, open_ in servers.items()}
    results: dict[str, dict[str, list[float]]] = {
        name: {"warm": [], "cold": []} for name in servers
    }
    try:
        for rnd in range(3):
            for name, (trip, _) in opened.items():
                for kind in ("warm", "cold") if rnd % 2 == 0 else ("cold", "warm"):
                    results[name][kind].append(_p50(trip, n, IDLE if kind == "cold" else 0.0))
    finally:
        for _, close in opened.values():
            close()
    print(
        f"round trip p50, us, median of 3 rounds of {n} [range]; "
        f"cold = after {IDLE * 1e3:.0f} ms idle"
    )
    print(f"{'':12} {'warm':>20} {'cold':>20} {'cold - warm':>12}")
    for name, kinds in results.items():
        warm, cold = kinds["warm"], kinds["cold"]
        line = f"{name:12}"
        for vals in (warm, cold):
            line += f" {statistics.median(vals):7.0f} [{min(vals):4.0f}-{max(vals):4.0f}]"
        print(f"{line} {statistics.median(cold) - statistics.median(warm):12.0f}")


if __name__ == "__main__":
    main()
