"""Benchmark kombu_pgqueue against Redis, RabbitMQ and Kombu's SQLAlchemy transport.

    python -m benchmarks [--quick] [--runs N] [--only NAME,...] [--dsn DSN]
                         [--brokers pgqueue,redis,rabbitmq,sqla] [--markdown FILE]

Every broker runs the same code, on the same machine, with the same Celery
settings (``bench_app.COMMON_SETTINGS``), in one invocation; runs are interleaved
(run 1 of every broker, then run 2, ...) so drift hits all alike. Each figure is
the median of ``--runs`` runs with its min-max range. A broker that cannot be
reached is reported as absent. See README.md for what each figure measures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

from .config import DEFAULT_DSN, DSN_ENV, SIZES, Ctx, Settings, log
from .figures import GROUPS
from .orchestrate import Results, run_all
from .peers import cleanup, make_brokers, probe
from .report import code_state, write_report

DEFAULT_BROKERS = "pgqueue,pgqueue_async,pgqueue_fast,redis,rabbitmq,rabbitmq_confirm,sqla"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes (a few minutes)")
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help="runs per figure (median, min-max); default 3, or 1 with --quick",
    )
    p.add_argument("--only", default="", help="comma-separated: " + ",".join(GROUPS))
    p.add_argument("--brokers", default=DEFAULT_BROKERS)
    p.add_argument(
        "--dsn",
        default=None,
        help="PostgreSQL of the pgqueue and sqla brokers and of the harness' own connection "
        f"(default: ${', $'.join(DSN_ENV)}, the first set, else {DEFAULT_DSN!r})",
    )
    p.add_argument("--deep", type=int, default=None, help="deep-backlog size for 'claim'")
    p.add_argument("--eta", type=int, default=None, help="number of ETA tasks for 'eta_rss'")
    p.add_argument("--markdown", default=None, help="also write the report as Markdown here")
    p.add_argument("--json", default=None, help="also write raw results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)

    if args.runs is None:
        args.runs = 1 if args.quick else 3
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    groups = [g.strip() for g in args.only.split(",") if g.strip()] or list(GROUPS)
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        ap.error(f"unknown --only names {bad}; choose from {list(GROUPS)}")
    groups = [g for g in GROUPS if g in groups]
    wanted = [b.strip() for b in args.brokers.split(",") if b.strip()]
    sizes = dict(SIZES["quick" if args.quick else "full"])
    if args.deep:
        sizes["deep_n"] = args.deep
    if args.eta:
        sizes["eta_n"] = args.eta
    try:
        settings = Settings.load(args.dsn)
    except Exception as exc:  # noqa: BLE001 - a DSN psycopg cannot parse, or a socket path
        ap.error(f"--dsn: {exc}")

    runid = uuid.uuid4().hex[:8]
    prefix = f"bench_{runid}"
    all_brokers = make_brokers(settings, prefix)
    unknown = [b for b in wanted if b not in all_brokers]
    if unknown:
        ap.error(f"unknown brokers {unknown}")
    brokers = {n: all_brokers[n] for n in all_brokers if n in wanted}
    tmp = tempfile.mkdtemp(prefix=f"{prefix}-")
    given = sys.argv[1:] if argv is None else argv
    ctx = Ctx(
        settings=settings,
        sizes=sizes,
        runs=args.runs,
        prefix=prefix,
        tmp=tmp,
        brokers=brokers,
        command=" ".join([os.path.basename(sys.executable), "-m", "benchmarks", *given]),
        code_at_start=code_state(),
    )

    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    results: Results = {}
    try:
        for b in brokers.values():
            probe(settings, b)
            log(f"{b.name}: {'available' if b.available else 'ABSENT (' + b.why_absent + ')'}")
        log(f"groups: {','.join(groups)}; runs: {args.runs}; sizes: {sizes}")
        results = run_all(ctx, groups)
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return_code = 130
    else:
        return_code = 0
    finally:
        cleanup(ctx)
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    if code_state() != ctx.code_at_start:
        ctx.notes.append(f"kombu_pgqueue CHANGED during the run: now {code_state()}")

    write_report(ctx, results, groups, elapsed, markdown=args.markdown, json_path=args.json)
    return return_code or (1 if ctx.problems else 0)
