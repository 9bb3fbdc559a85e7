"""What one invocation runs with (``Settings``, ``Ctx``), the sizes, and the log line.

Nothing here is module-level state: the DSN and the peers' URLs are read once by the
command line into a ``Settings``, and everything a run collects lives in its ``Ctx``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from .peers import Broker
    from .workers import Worker

#: the repository root: the workers run there (``python -m celery -A benchmarks.bench_app``)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test"
#: where the DSN comes from when --dsn is not given, first set wins (BENCH_PG_DSN: old name)
DSN_ENV = ("PGQUEUE_BENCH_DSN", "PGQUEUE_TEST_DSN", "BENCH_PG_DSN")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"

STEP_WATCHDOG = 300.0  # seconds

WORKER_FLAGS = ("--without-mingle", "--without-gossip", "-l", "WARNING")

SIZES: Mapping[str, Mapping[str, Any]] = {
    # caps are in seconds: a slow broker publishes what fits in the cap (noted in the output)
    "full": dict(
        kombu_n=5000,
        kombu_cap=10.0,
        consume_cap=20.0,
        celery_n=5000,
        publish_cap=8.0,
        drain_timeout=300.0,
        latency_n=200,
        latency_min=15,
        latency_cap=15.0,
        idle_settle=3.0,
        idle_window=20.0,
        deep_n=10_000_000,
        claim_reps=200,
        churn_n=50_000,
        bulk_n=1_000_000,
        bulk_tasks=200_000,
        eta_n=100_000,
        eta_settle_cap=45.0,
    ),
    "quick": dict(
        kombu_n=1000,
        kombu_cap=4.0,
        consume_cap=8.0,
        celery_n=1000,
        publish_cap=5.0,
        drain_timeout=120.0,
        latency_n=50,
        latency_min=8,
        latency_cap=5.0,
        idle_settle=2.0,
        idle_window=6.0,
        deep_n=300_000,
        claim_reps=30,
        churn_n=20_000,
        bulk_n=100_000,
        bulk_tasks=50_000,
        eta_n=5_000,
        eta_settle_cap=10.0,
    ),
}

#: the ~90-byte JSON message of the Kombu, claim and bulk figures
SMALL_BODY: Mapping[str, Any] = {"id": 0, "payload": "x" * 64}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dsn_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The first of PGQUEUE_BENCH_DSN, PGQUEUE_TEST_DSN, BENCH_PG_DSN set, or the default."""
    for name in DSN_ENV:
        if environ.get(name):
            return environ[name]
    return DEFAULT_DSN


@dataclass(frozen=True)
class Settings:
    """The servers: PostgreSQL (the harness' own connection and the pgqueue/sqla brokers)
    from one DSN, and the peers' URLs."""

    dsn: str
    redis_url: str = DEFAULT_REDIS_URL
    amqp_url: str = DEFAULT_AMQP_URL

    @classmethod
    def load(cls, dsn: str | None = None, environ: Mapping[str, str] = os.environ) -> Settings:
        """--dsn, else the environment; the peers' URLs from BENCH_REDIS_URL/BENCH_AMQP_URL."""
        settings = cls(
            dsn=dsn or dsn_from_env(environ),
            redis_url=environ.get("BENCH_REDIS_URL", DEFAULT_REDIS_URL),
            amqp_url=environ.get("BENCH_AMQP_URL", DEFAULT_AMQP_URL),
        )
        settings.pg_fields()  # fails early on a DSN the brokers' URLs cannot express
        return settings

    def pg_fields(self) -> dict[str, Any]:
        """host, port, user, password and dbname of the DSN (None where it has none)."""
        params = conninfo_to_dict(self.dsn)
        host = params.get("host") or "127.0.0.1"
        if host.startswith("/") or "," in host:
            raise ValueError(f"the DSN must name one TCP host, not {host!r}")
        port = params.get("port")
        return {
            "host": host,
            "port": int(port) if port else None,
            "user": params.get("user") or None,
            "password": params.get("password") or None,
            "dbname": params.get("dbname") or None,
        }

    @property
    def pg_hostport(self) -> tuple[str, int]:
        """Where the counting proxy forwards to."""
        f = self.pg_fields()
        return f["host"], f["port"] or 5432

    def pg_url(self, scheme: str, via_port: int | None = None) -> str:
        """A broker URL for the DSN's server, or for the counting proxy on ``via_port``."""
        f = self.pg_fields()
        auth = ""
        if f["user"]:
            auth = quote(f["user"], safe="")
            if f["password"]:
                auth += ":" + quote(f["password"], safe="")
            auth += "@"
        if via_port is not None:
            where = f"127.0.0.1:{via_port}"
        else:
            where = f["host"] + (f":{f['port']}" if f["port"] else "")
        return f"{scheme}://{auth}{where}/{quote(f['dbname'] or '', safe='')}"


@dataclass
class Ctx:
    """One invocation: its settings and sizes, and what it collects on the way."""

    settings: Settings
    sizes: dict[str, Any]
    runs: int
    prefix: str
    tmp: str
    brokers: dict[str, Broker]
    command: str = ""
    queues: dict[str, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the worker subprocesses still running (stopped by cleanup if a step did not)
    workers: list[Worker] = field(default_factory=list)
    code_at_start: str = ""

    def queue(self, broker: Broker, name: str) -> str:
        full = f"{self.prefix}_{name}"
        self.queues.setdefault(broker.name, set()).add(full)
        return full

    def problem(self, broker: str, figure: str, text: str) -> None:
        msg = f"[{broker}] {figure}: {text}"
        self.problems.append(msg)
        log("PROBLEM " + msg.splitlines()[0])
