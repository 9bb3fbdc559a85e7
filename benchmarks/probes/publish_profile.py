"""Where one apply_async's time goes, by library, sampled with py-spy, on any broker URL.

    python benchmarks/probes/publish_profile.py pgqueue://postgres@127.0.0.1/test
    python benchmarks/probes/publish_profile.py amqp://guest:guest@127.0.0.1:5672//

Runs N back-to-back ``apply_async`` calls under ``py-spy record`` (1,000 samples/s) and
charges each sample to the innermost frame that belongs to a library we can name:
psycopg waiting for the server (the round trip: the statement's execution and the
commit's WAL flush), the rest of psycopg and psycopg_pool, kombu_pgqueue, kombu, amqp,
celery. Standard-library frames (json, uuid, socket) count for the library that called
them. Prints each share and its milliseconds per call.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
import time

N = int(os.environ.get("PROBE_CALLS", "5000"))
#: (bucket, path fragment, functions or None for any), innermost match wins
OWNERS = [
    ("PostgreSQL round trip (psycopg waits)", "psycopg/", {"Connection.wait"}),
    ("psycopg_pool", "psycopg_pool/", None),
    ("psycopg (Python side)", "psycopg/", None),
    ("kombu_pgqueue", "kombu_pgqueue/", None),
    ("amqp (socket write)", "amqp/", None),
    ("kombu", "kombu/", None),
    ("celery", "celery/", None),
]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:]*):\d+\)$")


def loop(url: str) -> None:
    from celery import Celery

    import kombu_pgqueue  # noqa: F401 - registers pgqueue://

    app = Celery("probe", broker=url)
    app.conf.broker_transport_options = {"schema": "probe_s"}

    @app.task(name="probe")
    def probe() -> None:
        pass

    probe.apply_async()  # connect and declare outside the timed calls
    began = time.perf_counter()
    for _ in range(N):
        probe.apply_async()
    print(f"{N} apply_async in {time.perf_counter() - began:.2f} s", flush=True)


def owner(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        m = FRAME.match(frame)
        if not m:
            continue
        for bucket, fragment, funcs in OWNERS:
            if m["file"].startswith(fragment) and (funcs is None or m["func"] in funcs):
                return bucket
    return "other (interpreter, start-up)"


def main() -> None:
    if sys.argv[1] == "--loop":
        loop(sys.argv[2])
        return
    url = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "stacks.txt")
        out = subprocess.run(
            [
                "py-spy",
                "record",
                "--idle",
                "--nonblocking",
                "-r",
                "1000",
                "-f",
                "raw",
                "-o",
                raw,
                "--",
                sys.executable,
                __file__,
                "--loop",
                url,
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        done = next(line for line in out.splitlines() if " apply_async in " in line)
        seconds = float(done.split(" in ")[1].split()[0])
        counts: collections.Counter[str] = collections.Counter()
        for line in open(raw):
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if "Task.apply_async" in stack:  # the timed calls, not imports and set-up
                counts[owner(stack)] += int(n)
    total = sum(counts.values())
    per_call = seconds / N * 1000
    print(f"{url.split(':')[0]}: {per_call:.3f} ms per apply_async; {total} samples in it")
    for bucket, n in counts.most_common():
        print(f"  {bucket:<40} {n / total:6.1%}  {per_call * n / total:.3f} ms")


if __name__ == "__main__":
    main()
