#!/usr/bin/env python
"""Run the chaos scenarios and print a ledger for each.

    python -m benchmarks.chaos [scenario ...] [--tasks N] [--minutes M] [--quick]
    python benchmarks/chaos/run.py kill --tasks 5000    # from the repo root: the same

Scenarios: kill, handoff, relay, long, dbrestart, listenkill, poison, load, snapshot, failover,
atomic, dumps, beat
(default: all).
The exit status is 0 when every scenario passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: hand over to `python -m benchmarks.chaos`
    _root = Path(__file__).resolve().parents[2]
    if Path.cwd().resolve() != _root:
        sys.exit(f"run it from the repository root {_root}: python -m benchmarks.chaos ...")
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.chaos", *sys.argv[1:]])

from benchmarks.chaos import (  # noqa: E402
    atomic,
    beat,
    celery_scenarios,
    dumps,
    failover,
    kombu_scenarios,
    procs,
    server_scenarios,
    snapshot,
)
from benchmarks.chaos.context import Context, Result  # noqa: E402

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCENARIOS = [
    "kill",
    "handoff",
    "relay",
    "long",
    "dbrestart",
    "listenkill",
    "poison",
    "load",
    "snapshot",
    "failover",
    "atomic",
    "dumps",
    "beat",
]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "scenarios",
        nargs="*",
        metavar="scenario",
        help=f"any of {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument(
        "--tasks", type=int, help="tasks for kill, handoff, dbrestart, poison, failover, atomic"
    )
    parser.add_argument("--minutes", type=float, help="duration of load, and of the open snapshot")
    parser.add_argument(
        "--quick", action="store_true", help="everything small: a few minutes in all"
    )
    parser.add_argument(
        "--dsn",
        default=os.environ.get("CHAOS_DSN", DEFAULT_DSN),
        help=f"database (default {DEFAULT_DSN}; or CHAOS_DSN)",
    )
    parser.add_argument("--rate", type=float, default=800.0, help="load: total publish rate, msg/s")
    parser.add_argument(
        "--vacuum-every",
        type=float,
        default=10.0,
        help="load/snapshot: VACUUM the message table every S s (0: never); "
        "stands in for autovacuum, which the test server runs without",
    )
    parser.add_argument(
        "--hold",
        choices=("snapshot", "dump", "none"),
        default="dump",
        help="snapshot: what the held transaction does: read no broker table (an analytics "
        "query, a standby's feedback: 'snapshot') or, as pg_dump, hold ACCESS SHARE on "
        "every broker table ('dump', the default); 'none' holds nothing, a control run "
        "that shows how much the minutes vary on their own",
    )
    parser.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="snapshot: run the same load at the same time in a second database where "
        "nothing is held, and judge each minute of the hold against the control's same "
        "minute (the default); --no-paired judges against the before phase alone",
    )
    parser.add_argument("--keep", action="store_true", help="keep the schemas and ledger tables")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    args.scenarios = args.scenarios or SCENARIOS
    return args


def run_one(ctx: Context, name: str, args: argparse.Namespace) -> Result:
    began = time.monotonic()
    try:
        if name == "load":
            result = kombu_scenarios.load(ctx, args.rate, args.vacuum_every)
        elif name == "snapshot":
            result = snapshot.snapshot(ctx, args.vacuum_every, args.hold, args.paired)
        elif name == "dumps":
            result = dumps.dumps(ctx, args.vacuum_every, min(args.rate, 400.0))
        elif name == "failover":
            result = failover.failover(ctx)
        elif name == "atomic":
            result = atomic.atomic(ctx)
        elif name == "beat":
            result = beat.beat(ctx)
        elif name in ("dbrestart", "listenkill"):
            result = getattr(server_scenarios, name)(ctx)
        else:
            result = getattr(celery_scenarios, name)(ctx)
    except Exception:  # noqa: BLE001 - one broken scenario must not hide the others
        result = Result(name, False, notes=["scenario raised:\n" + traceback.format_exc()])
    result.seconds = time.monotonic() - began
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logs = Path(tempfile.mkdtemp(prefix="pgqueue-chaos-"))
    ctx = Context(args.dsn, args.dsn, logs, args.tasks, args.minutes, args.quick, args.keep)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"pgqueue chaos, {started:%Y-%m-%d %H:%M} UTC: {' '.join(sys.argv)}")
    results = []
    try:
        for name in args.scenarios:
            result = run_one(ctx, name, args)
            result.print()
            results.append(result)
    finally:
        procs.pg_ensure_running()
    print("\n=== summary")
    for result in results:
        print(f"  {result.name:<11} {'PASS' if result.passed else 'FAIL'}  {result.seconds:6.0f} s")
    print(f"  worker logs: {logs}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
