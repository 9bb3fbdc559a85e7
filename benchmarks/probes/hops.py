"""Idle-worker latency, hop by hop: apply_async -> task start on a prefork -c 2 worker.

    python benchmarks/probes/hops.py BROKER [N] [--wait sleep|poll|block] [--fake-claim]

BROKER: ``pgqueue``, ``pgqueue_async`` (synchronous_commit=off) or ``rabbitmq``. N (200)
sequential tasks, ~20 ms idle between them; prints each hop's p50/p95 since apply_async
began and the p50/p95 of the hop's own share (per-task differences). Hops: pub_start /
pub_end (the publish statement sent / answered), ret (apply_async returned), woke (the
worker's epoll returned), notified (LoopDriver._on_notified), claim_start / claim_end
(Store.run_claim) with exec_start / exec_end (its psycopg execute), hand_out
(Consumer._hand_out), deliver (kombu Consumer._receive_callback), apply (billiard
Pool.apply_async), child_recv (the pool child's wait_for_job returned), task_start.

``--wait``: ``poll`` is the harness's measure_latency (time.sleep(0.001) + reading the
sink file); ``block`` blocks on a unix datagram the task sends; ``sleep`` watches nothing
(25 ms between sends). ``--fake-claim`` (pgqueue, a what-if only): the claim returns a
copy of the first message it claimed without asking the server; the real rows stay
unclaimed (safety poll off): what a NOTIFY that carried the message would gain.
PGQUEUE_BENCH_DSN names the database (``own_cluster.py`` sets it).
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from celery import Celery, signals

import kombu_pgqueue  # noqa: F401 - registers pgqueue://

HERE = os.path.dirname(os.path.abspath(__file__))
ROLE = os.environ.get("HOPS_ROLE", "driver")
BROKER = os.environ.get("HOPS_BROKER", "pgqueue")
TRACE = os.environ.get("HOPS_TRACE", "/tmp/hops_trace.log")
SOCK = os.environ.get("HOPS_SOCK", "/tmp/hops.sock")
FAKE = os.environ.get("HOPS_FAKE_CLAIM") == "1"
DSN = os.environ.get("PGQUEUE_BENCH_DSN", "postgresql://postgres@127.0.0.1:5432/test")
QUEUE = "probe_hops"
SCHEMA = "probe_hops_async" if BROKER == "pgqueue_async" else "probe_hops"


def broker_url() -> tuple[str, dict[str, Any]]:
    if BROKER == "rabbitmq":
        return "amqp://guest:guest@127.0.0.1:5672//", {}
    from psycopg.conninfo import conninfo_to_dict

    c = conninfo_to_dict(DSN)
    url = f"pgqueue://{c.get('user', 'postgres')}@{c.get('host', '127.0.0.1')}"
    url += f":{c.get('port', 5432)}/{c.get('dbname', 'test')}"
    opts: dict[str, Any] = {"schema": SCHEMA, "polling_interval": 3600.0 if FAKE else 5.0}
    if BROKER == "pgqueue_async":
        opts["synchronous_commit"] = "off"
    return url, opts


sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from benchmarks.bench_app import COMMON_SETTINGS  # noqa: E402

_url, _opts = broker_url()
app = Celery("hops", broker=_url, set_as_current=False)
app.conf.update(
    COMMON_SETTINGS,
    broker_transport_options=_opts,
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    worker_hijack_root_logger=False,
)

#: (event, epoch seconds) of this process, written out when idle
EVENTS: list[tuple[str, float]] = []
_woke = [0.0]


def _write(lines: list[str]) -> None:
    with open(TRACE, "a") as f:  # one write: lines of other processes do not interleave
        f.write("".join(lines))


def _flush() -> None:
    events, EVENTS[:] = list(EVENTS), []
    if events:
        _write([f"{t:.6f} {name}\n" for name, t in events])


_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
_sock.setblocking(False)  # a driver that polls the file reads none of these
_child_recv = [0.0]


@app.task(name="hops.lat")
def lat(seq: int, sent: float) -> None:
    now = time.time()
    try:
        _sock.sendto(b"x", SOCK)
    except OSError:
        pass
    _write([f"{_child_recv[0]:.6f} child_recv\n{now:.6f} task_start\n"])


def _install_worker_hooks() -> None:
    import billiard.pool
    from kombu import messaging
    from kombu.asynchronous import get_event_loop
    from kombu.utils import eventio

    poll = eventio._epoll.poll

    def epoll_poll(self: Any, timeout: Any) -> Any:
        events = poll(self, timeout)
        if events:
            _woke[0] = time.time()
        return events

    eventio._epoll.poll = epoll_poll  # type: ignore[method-assign]

    receive = messaging.Consumer._receive_callback

    def _receive_callback(self: Any, message: Any) -> Any:
        if BROKER == "rabbitmq":
            EVENTS.append(("woke", _woke[0]))
        EVENTS.append(("deliver", time.time()))
        return receive(self, message)

    messaging.Consumer._receive_callback = _receive_callback  # type: ignore[method-assign]

    apply_async = billiard.pool.Pool.apply_async

    def pool_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        EVENTS.append(("apply", time.time()))
        try:
            return apply_async(self, *args, **kwargs)
        finally:
            loop = get_event_loop()
            if loop is not None:
                loop.call_later(0.008, _flush)

    billiard.pool.Pool.apply_async = pool_apply  # type: ignore[method-assign]

    make = billiard.pool.Worker._make_child_methods

    def _make_child_methods(self: Any, *args: Any, **kwargs: Any) -> Any:
        make(self, *args, **kwargs)
        wait = self.wait_for_job

        def wait_for_job() -> Any:
            req = wait()
            _child_recv[0] = time.time()
            return req

        self.wait_for_job = wait_for_job

    billiard.pool.Worker._make_child_methods = _make_child_methods  # type: ignore[method-assign]

    if BROKER == "rabbitmq":
        return
    from dataclasses import replace

    from kombu_pgqueue import _consumer, _loop, _store
    from kombu_pgqueue.records import ClaimResult

    notified = _loop.LoopDriver._on_notified

    def _on_notified(self: Any, fileno: int) -> None:
        EVENTS.append(("woke", _woke[0]))
        EVENTS.append(("notified", time.time()))
        notified(self, fileno)

    _loop.LoopDriver._on_notified = _on_notified  # type: ignore[method-assign]

    import psycopg

    run_claim = _store.Store.run_claim
    template: list[Any] = []
    fake_id = [10**12]
    in_claim = [False]
    execute = psycopg.Connection.execute

    def conn_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not in_claim[0]:
            return execute(self, *args, **kwargs)
        EVENTS.append(("exec_start", time.time()))
        result = execute(self, *args, **kwargs)
        EVENTS.append(("exec_end", time.time()))
        return result

    psycopg.Connection.execute = conn_execute  # type: ignore[method-assign]

    def claim(self: Any, request: Any) -> Any:
        EVENTS.append(("claim_start", time.time()))
        in_claim[0] = True
        try:
            return _claim(self, request)
        finally:
            in_claim[0] = False
            EVENTS.append(("claim_end", time.time()))

    def _claim(self: Any, request: Any) -> Any:
        if FAKE and template:
            fake_id[0] += 1
            result = ClaimResult(request, [replace(template[0], id=fake_id[0])], 0.0)
        else:
            result = run_claim(self, request)
            if FAKE and result.rows and not template:
                template.append(result.rows[0])
        return result

    _store.Store.run_claim = claim  # type: ignore[method-assign]

    hand_out = _consumer.Consumer._hand_out

    def _hand_out(self: Any, *args: Any, **kwargs: Any) -> Any:
        EVENTS.append(("hand_out", time.time()))
        return hand_out(self, *args, **kwargs)

    _consumer.Consumer._hand_out = _hand_out  # type: ignore[method-assign]


if ROLE == "worker":
    _install_worker_hooks()

    @signals.worker_ready.connect(weak=False)
    def _ready(**kwargs: Any) -> None:
        _write([f"{time.time():.6f} ready\n"])


# -- the driver ------------------------------------------------------------------------------

ORDER = (
    "pub_start", "pub_end", "ret", "woke", "notified", "claim_start", "exec_start",
    "exec_end", "claim_end", "hand_out", "deliver", "apply", "child_recv", "task_start",
)  # fmt: skip


def _clean() -> None:
    if BROKER == "rabbitmq":
        with app.connection_for_write() as conn:
            ch = conn.default_channel
            try:
                ch.queue_purge(QUEUE)
            except Exception:  # noqa: S110 - not declared yet
                pass
        return
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')


def _install_driver_hooks(events: list[tuple[str, float]]) -> None:
    if BROKER == "rabbitmq":
        return
    from kombu_pgqueue import _connected, _sql

    rows = _connected.Connected.rows
    traits = _sql.traits()

    def _rows(self: Any, name: str, params: Any, **kwargs: Any) -> Any:
        if traits[name].publish:
            events.append(("pub_start", time.time()))
            try:
                return rows(self, name, params, **kwargs)
            finally:
                events.append(("pub_end", time.time()))
        return rows(self, name, params, **kwargs)

    _connected.Connected.rows = _rows  # type: ignore[method-assign]


def drive(n: int, wait: str) -> dict[str, Any]:
    _clean()
    for path in (TRACE, SOCK):
        if os.path.exists(path):
            os.unlink(path)
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(SOCK)
    env = dict(os.environ, HOPS_ROLE="worker", HOPS_BROKER=BROKER, HOPS_TRACE=TRACE)
    env["HOPS_FAKE_CLAIM"] = "1" if FAKE else "0"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "hops", "worker", "-P", "prefork", "-c", "2",
         "--without-mingle", "--without-gossip", "-l", "WARNING", "-Q", QUEUE],
        cwd=HERE, env=env, stdout=open(TRACE + ".worker", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    sends: list[float] = []
    driver: list[tuple[str, float]] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            if os.path.exists(TRACE) and "ready" in open(TRACE).read():
                break
            time.sleep(0.1)
        time.sleep(1.0)
        _install_driver_hooks(driver)
        offset = os.path.getsize(TRACE)
        cpu0 = time.process_time()
        for seq in range(n + 5):
            t = time.time()
            sends.append(t)
            lat.apply_async((seq, t))
            driver.append(("ret", time.time()))
            if wait == "sleep":
                time.sleep(0.025)
                continue
            if wait == "block":
                rx.settimeout(15)
                rx.recv(16)
            else:  # the harness's loop: 1 ms sleeps, reading the sink file each time
                until = time.monotonic() + 15
                seen = False
                while not seen and time.monotonic() < until:
                    time.sleep(0.001)
                    with open(TRACE) as f:
                        f.seek(offset)
                        data = f.read()
                        offset = f.tell()
                    seen = "task_start" in data
            time.sleep(0.02)
        cpu = time.process_time() - cpu0
        time.sleep(0.5)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        rx.close()
    events = driver + [(ln.split()[1], float(ln.split()[0])) for ln in open(TRACE)]
    per: list[dict[str, float]] = [{} for _ in sends]
    for name, t in events:
        i = bisect.bisect_right(sends, t) - 1
        if i >= 0:
            per[i].setdefault(name, (t - sends[i]) * 1000)
    per = [p for p in per[5:] if "task_start" in p]
    return {"tasks": per, "driver_cpu_ms_per_task": cpu * 1000 / (n + 5)}


def q(vals: list[float], p: float) -> float:
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(len(vals) * p))]


def report(per: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(per)}
    prev = None
    for key in ORDER:
        vals = [p[key] for p in per if key in p]
        if len(vals) < len(per) * 0.9:
            continue
        row = {"p50": statistics.median(vals), "p95": q(vals, 0.95), "p99": q(vals, 0.99)}
        if prev is not None:
            d = [p[key] - p[prev] for p in per if key in p and prev in p]
            row["hop_p50"] = statistics.median(d)
            row["hop_p95"] = q(d, 0.95)
        out[key] = row
        if key != "ret" or "pub_end" not in out:  # woke: since the commit, not the return
            prev = key
    # the same tasks less their claim's time: the what-if within one run (no run-to-run noise)
    less = [p["task_start"] - p["claim_end"] + p["claim_start"] for p in per if "claim_end" in p]
    if len(less) >= len(per) * 0.9:
        out["less_claim"] = {"p50": statistics.median(less), "p95": q(less, 0.95)}
        out["less_claim"]["p99"] = q(less, 0.99)
    return out


def main() -> None:
    args = sys.argv[1:]
    wait = "poll"
    if "--wait" in args:
        i = args.index("--wait")
        wait = args[i + 1]
        del args[i : i + 2]
    n = int(args[1]) if len(args) > 1 and args[1].isdigit() else 200
    result = drive(n, wait)
    out = report(result["tasks"])
    out["driver_cpu_ms_per_task"] = result["driver_cpu_ms_per_task"]
    print(f"# {BROKER} wait={wait} fake_claim={FAKE} n={out['n']} load={os.getloadavg()}")
    for key in (*ORDER, "less_claim"):
        if key in out:
            r = out[key]
            hop = f" hop p50 {r['hop_p50']:6.3f} p95 {r['hop_p95']:6.3f}" if "hop_p50" in r else ""
            print(f"{key:12} p50 {r['p50']:6.3f} p95 {r['p95']:6.3f} p99 {r['p99']:6.3f}{hop}")
    print(f"driver CPU {out['driver_cpu_ms_per_task']:.3f} ms per task")
    print("JSON " + json.dumps({"broker": BROKER, "wait": wait, "fake": FAKE, **out}))


if __name__ == "__main__":
    # the broker (and fake mode) decide the app's options at import: re-exec with them set
    argv = sys.argv[1:]
    want = argv[0] if argv else "pgqueue"
    fake = "--fake-claim" in argv
    if os.environ.get("HOPS_BROKER") != want or (fake and not FAKE):
        env = dict(os.environ, HOPS_BROKER=want, HOPS_FAKE_CLAIM="1" if fake else "0")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    main()
