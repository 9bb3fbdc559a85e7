"""``celery worker`` subprocesses and the sink file their signal handlers append to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from .config import ROOT, WORKER_FLAGS, Ctx
from .peers import Broker

#: the Celery app the workers run; importable from ROOT, their working directory
WORKER_APP = "benchmarks.bench_app"


class Sink:
    """Reads what the worker's signal handlers append (see bench_app)."""

    def __init__(self, path: str) -> None:
        self.path = path
        open(path, "w").close()
        self._offset = 0
        self._partial = ""
        self.ready = False
        self.done: list[tuple[float, float, str]] = []
        self.latency: list[tuple[float, float]] = []

    def read(self) -> None:
        with open(self.path) as f:
            f.seek(self._offset)
            data = f.read()
            self._offset = f.tell()
        if not data:
            return
        data = self._partial + data
        lines = data.split("\n")
        self._partial = lines.pop()
        for line in lines:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "ready":
                self.ready = True
            elif parts[0] == "e":
                self.done.append((float(parts[1]), float(parts[2]), parts[3]))
            elif parts[0] == "l":
                self.latency.append((float(parts[1]), float(parts[2])))


class Worker:
    """A ``celery worker`` subprocess in its own process group, listed in ``ctx.workers``
    until it is stopped."""

    def __init__(
        self,
        ctx: Ctx,
        broker: Broker,
        queue: str,
        pool: str,
        concurrency: int,
        url: str | None = None,
        tag: str = "w",
    ) -> None:
        self.sink = Sink(os.path.join(ctx.tmp, f"sink-{queue}-{tag}.txt"))
        self.logfile = os.path.join(ctx.tmp, f"worker-{queue}-{tag}.log")
        env = dict(os.environ)
        env.update(
            BENCH_BROKER_URL=url or broker.url,
            BENCH_TRANSPORT_OPTIONS=json.dumps(broker.options),
            BENCH_QUEUE=queue,
            BENCH_SINK=self.sink.path,
        )
        self.cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            WORKER_APP,
            "worker",
            "--pool",
            pool,
            "-c",
            str(concurrency),
            *WORKER_FLAGS,
            "-n",
            f"{queue}-{tag}@%h",
        ]
        self._log = open(self.logfile, "wb")
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started = time.time()
        self.killed = False
        self._registry = ctx.workers
        self._registry.append(self)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sink.read()
            if self.sink.ready:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.logfile, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def pids(self) -> list[int]:
        """The worker's processes (its process group)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getpgid(int(entry)) == self.proc.pid:
                        found.append(int(entry))
                except OSError:
                    pass
        return found

    def rss_mb(self) -> float:
        total = 0
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024.0

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.killed = self.proc.poll() is None
        # the children too, even if the main process is already gone
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        if self in self._registry:
            self._registry.remove(self)
