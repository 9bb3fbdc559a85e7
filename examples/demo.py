"""The pgqueue demo: a real Celery worker doing real tasks through PostgreSQL.

    python examples/demo.py            # embedded PostgreSQL, nothing else needed
    PGQUEUE_DSN=postgresql://... python examples/demo.py

It starts a worker process, sends plain, routed, prioritised, delayed, retried
and chord tasks, waits for every result, shows ``celery pgqueue queues``, and
stops the worker with a warm shutdown. Exit status 0 means every result was right.

On a database of yours it keeps to a schema of its own (``pgqueue_demo``, see
``tasks.py``): your broker's schema and queues are never read or written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main() -> int:
    from kombu_pgqueue import embedded

    dsn = os.environ.get("PGQUEUE_DSN")
    if not dsn:
        print("no PGQUEUE_DSN: starting an embedded PostgreSQL ...", flush=True)
        dsn = embedded.start()
        os.environ["PGQUEUE_DSN"] = dsn
    print(f"broker: {embedded.broker_url(dsn)}", flush=True)

    import tasks
    from celery import chord

    import kombu_pgqueue

    # before the first result: Celery's result backend makes its tables in this schema
    kombu_pgqueue.migrate(dsn, tasks.SCHEMA)
    print(f"schema: {tasks.SCHEMA}, queues: {tasks.QUEUE}, {tasks.IO_QUEUE}", flush=True)

    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tasks",
            "worker",
            "-Q",
            f"{tasks.QUEUE},{tasks.IO_QUEUE}",
            "-c",
            "2",
            "-l",
            "warning",
            "-n",
            f"demo-{os.getpid()}@%h",
        ],
        cwd=HERE,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )
    try:
        started = time.monotonic()
        sums = [tasks.add.delay(i, i) for i in range(50)]
        digests = [tasks.checksum.delay(f"row {i}") for i in range(10)]
        urgent = tasks.add.apply_async((1000, 1), priority=9)
        later = tasks.add.apply_async((2, 3), countdown=2)
        retried = tasks.flaky.delay(7)
        fan_in = chord(tasks.add.s(i, 1) for i in range(10))(tasks.total.s())

        checks = {
            "50 adds": [r.get(timeout=60) for r in sums] == [2 * i for i in range(50)],
            f"10 checksums on queue {tasks.IO_QUEUE!r}": all(
                len(r.get(timeout=60)) == 16 for r in digests
            ),
            "priority 9 task": urgent.get(timeout=60) == 1001,
            "countdown=2 task": later.get(timeout=60) == 5,
            "task retried twice, then ok": retried.get(timeout=60) == 7.0,
            "chord of 10 into total": fan_in.get(timeout=60) == sum(range(1, 11)),
        }
        elapsed = time.monotonic() - started
        for name, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
        print(f"{sum(checks.values())}/{len(checks)} checks passed in {elapsed:.1f}s", flush=True)

        print("\n$ celery -A tasks pgqueue queues", flush=True)
        subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tasks", "pgqueue", "queues"],
            cwd=HERE,
            env={**os.environ, "PYTHONPATH": str(HERE)},
            check=True,
        )
        return 0 if all(checks.values()) else 1
    finally:
        worker.send_signal(signal.SIGTERM)  # warm shutdown
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        embedded.stop()


if __name__ == "__main__":
    sys.exit(main())
