"""Where a prefork -c 2 drain spends the machine's CPU, per task, on any broker URL.

    python benchmarks/probes/drain_cpu.py pgqueue://postgres@127.0.0.1/test [N]
    python benchmarks/probes/drain_cpu.py amqp://guest:guest@127.0.0.1:5672// [N]
    PROBE_STATEMENTS=1 PROBE_DSN='host=127.0.0.1 port=5433 dbname=test user=postgres' \
        python benchmarks/probes/drain_cpu.py pgqueue://postgres@127.0.0.1:5433/test 20000

Loads N no-op tasks (default 30,000; pgqueue by COPY, other brokers by apply_async),
starts ``celery -A lat_app worker -P prefork -c 2``, and reads every process's CPU time
(/proc/PID/stat, user + system) when the 3,000th task starts and when the (N-3,000)th
does, so start-up and the tail are left out. Prints tasks/s over that stretch and the
CPU microseconds per task (user and system) of: the worker's main process, its pool
children, PostgreSQL backends, RabbitMQ (beam.smp), Redis, everything else.

``PROBE_DSN`` is the libpq DSN of the broker's database (default the shared server's).
``PROBE_STATEMENTS=1`` also prints, per task, the calls and execution time of the 25
costliest statements over the same stretch, from pg_stat_statements (reset at the first
mark): the server must load it (``shared_preload_libraries``; not so on the shared
server: start a cluster of its own) and the database have the extension.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")
MARGIN = 3000
DSN = os.environ.get("PROBE_DSN", "host=127.0.0.1 dbname=test user=postgres")
STATEMENTS = os.environ.get("PROBE_STATEMENTS") == "1"


def cpu() -> dict[int, tuple[str, int, float, float]]:
    """pid -> (command, parent pid, user CPU seconds, system CPU seconds) per process."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(pid)] = (comm, int(fields[1]), int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def statements(reset: bool) -> list[tuple[int, int, float, str]]:
    """Reset pg_stat_statements, or read (calls, rows, exec ms, query) of the costliest."""
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as c:
        if reset:
            c.execute("SELECT pg_stat_statements_reset()")
            return []
        return c.execute(
            "SELECT calls, rows, total_exec_time,"
            " left(regexp_replace(query, '\\s+', ' ', 'g'), 100)"
            " FROM pg_stat_statements"
            " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " ORDER BY total_exec_time DESC LIMIT 25"
        ).fetchall()


def main() -> None:
    url = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30000
    trace = "/tmp/probe_drain_cpu.log"
    env = {**os.environ, "PROBE_BROKER": url, "PROBE_TRACE": trace, "PROBE_SCHEMA": "probe_s"}
    os.environ.update(env)
    if url.startswith("pgqueue"):
        import psycopg

        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute('DROP SCHEMA IF EXISTS "probe_s" CASCADE')
    from lat_app import app, noop

    if url.startswith("pgqueue"):
        from celery_pgqueue.bulk import send_many

        send_many(app, (noop.s() for _ in range(n)))
    else:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge("celery")
        for _ in range(n):
            noop.apply_async()
    if os.path.exists(trace):
        os.remove(trace)
    worker = subprocess.Popen(
        [
            "celery",
            "-A",
            "lat_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "--without-mingle",
            "--without-gossip",
            "-l",
            "WARNING",
        ],
        cwd=HERE,
        env=env,
    )
    marks = []
    read: list[tuple[int, int, float, str]] = []
    try:
        for goal in (MARGIN, n - MARGIN):
            while lines(trace) < goal:
                time.sleep(0.01)
            marks.append((time.monotonic(), lines(trace), cpu()))
            if STATEMENTS:
                read = statements(reset=len(marks) == 1)
    finally:
        worker.kill()  # what it still holds goes back to its broker; not measured
        worker.wait()
    (t0, n0, before), (t1, n1, after) = marks
    tasks = n1 - n0
    groups: dict[str, list[float]] = {}
    for pid, (comm, ppid, user, system) in after.items():
        _, _, user0, system0 = before.get(pid, (comm, ppid, 0.0, 0.0))
        if pid == worker.pid:
            group = "worker main process"
        elif ppid == worker.pid:
            group = "worker pool children"
        elif comm.startswith("postgres"):
            group = "PostgreSQL"
        elif comm.startswith(("beam", "erl")):
            group = "RabbitMQ"
        elif comm.startswith("redis"):
            group = "Redis"
        else:
            group = "other"
        pair = groups.setdefault(group, [0.0, 0.0])
        pair[0] += user - user0
        pair[1] += system - system0
    total = sum(u + s for u, s in groups.values())
    print(
        f"{url.split(':')[0]}: {tasks / (t1 - t0):.0f} tasks/s over {tasks} tasks; "
        f"CPU {total / tasks * 1e6:.0f} us per task, {total / (t1 - t0):.2f} cores"
    )
    if read:
        print(f"  statements: {sum(r[2] for r in read) * 1000 / tasks:.1f} us a task executing")
    for calls, rows, ms, query in read:
        print(
            f"    {calls / tasks:6.3f} calls/task {rows / max(calls, 1):6.1f} rows/call "
            f"{ms * 1000 / tasks:6.1f} us/task | {query}"
        )
    for group, (user, system) in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"  {group:<22} {(user + system) / tasks * 1e6:5.0f} us/task "
            f"(user {user / tasks * 1e6:4.0f}, system {system / tasks * 1e6:4.0f})  "
            f"{(user + system) / (t1 - t0):.2f} cores"
        )


if __name__ == "__main__":
    main()
