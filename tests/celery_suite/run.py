"""Celery's own integration suite, on pgqueue and on RabbitMQ, side by side.

    python tests/celery_suite/run.py                     # both brokers, the three files
    python tests/celery_suite/run.py --brokers pgqueue   # one broker
    python tests/celery_suite/run.py -- -k replace       # extra pytest arguments
    tox -e celery-suite

The suite comes from the sdist of the installed Celery version (``pip download``, kept in
``--cache``). Each broker runs it with the same result backend (Celery's SQLAlchemy
backend on a database of its own) and a fresh broker database state; then the failures
are compared by test id: those that fail on pgqueue only are what this project must fix
(``test_scheduled`` is expected: ETA tasks wait in PostgreSQL, not in the worker, see
docs/migrating.md). Exit status 1 when any other test fails on pgqueue only.

Needs RabbitMQ (``--amqp``, default ``pyamqp://guest:guest@127.0.0.1:5672//``), Redis
(some canvas tests keep their bookkeeping there; ``REDIS_HOST``/``REDIS_PORT``) and a
PostgreSQL the role may create databases on (``--dsn``, default ``$PGQUEUE_TEST_DSN``).
About 35 minutes for both brokers: not part of the per-commit CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

FILES = ("test_tasks.py", "test_inspect.py", "test_canvas.py")
#: fails on pgqueue by design (docs/migrating.md: `celery inspect scheduled`)
EXPECTED_PGQUEUE_ONLY = {"t/integration/test_inspect.py::test_Inspect::test_scheduled"}
#: what the suite imports beyond this project's test extra
NEEDS = ("pytest_rerunfailures", "redis", "pydantic")
MARKERS = ("sleepdeprived_patched_module", "masked_modules", "patched_environ", "patched_module")
MARKERS += ("flaky", "timeout", "amqp")


def fetch_suite(cache: Path) -> Path:
    import celery

    version = celery.__version__
    # only the tests (t/): the sdist's own celery/ beside them would shadow the installed one
    root = cache / f"celery-{version}-tests"
    if (root / "t" / "integration").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        + ["--dest", str(cache), f"celery=={version}"],
        check=True,
    )
    prefix = f"celery-{version}/t/"
    with tarfile.open(cache / f"celery-{version}.tar.gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name.removeprefix(f"celery-{version}/")
        archive.extractall(root, members=members, filter="data")
    # the sdist's pytest settings (pyproject.toml), which stayed behind with celery/
    (root / "pytest.ini").write_text(
        "[pytest]\npython_classes = test_*\nxfail_strict = true\nmarkers =\n"
        + "".join(f"    {marker}\n" for marker in MARKERS)
    )
    return root


def fresh_database(dsn: str, name: str) -> str:
    """Drop and create database ``name`` on the server of ``dsn``; return its DSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(dsn)
    params["dbname"] = name
    return make_conninfo(**params)


def run_broker(
    suite: Path, broker: str, broker_url: str, backend: str, out: Path, extra: list[str]
) -> Path:
    report = out / f"{broker}.xml"
    env = dict(os.environ, TEST_BROKER=broker_url, TEST_BACKEND=backend)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:pgqueue"]
    # registers the pgqueue:// scheme in the test process (the worker runs in it)
    command += ["-p", "kombu_pgqueue", "-p", "celery.contrib.pytest"]
    command += ["--junitxml", str(report), "-q", "-o", "addopts="]
    command += [f"t/integration/{name}" for name in FILES] + extra
    print(f"\n== {broker}: {' '.join(command[2:])}", flush=True)
    started = time.monotonic()
    subprocess.run(command, cwd=suite, env=env, check=False)
    print(f"== {broker}: {time.monotonic() - started:.0f} s", flush=True)
    return report


def outcomes(report: Path) -> tuple[dict[str, int], set[str]]:
    """(counts by outcome, ids of the tests that failed or errored)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed: set[str] = set()
    for case in ET.parse(report).iter("testcase"):
        # classname "t.integration.test_canvas.test_chain": the module, then classes
        parts = case.get("classname", "").split(".")
        module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        test_path = "/".join(parts[: module + 1]) + ".py"
        test_id = "::".join([test_path, *parts[module + 1 :], case.get("name", "")])
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.add(test_id)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="pgqueue,amqp")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("PGQUEUE_TEST_DSN")
        or "host=127.0.0.1 dbname=postgres user=postgres",
    )
    parser.add_argument("--amqp", default="pyamqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--cache", type=Path, default=Path(".celery-suite"))
    parser.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()

    missing = [name for name in NEEDS if _missing(name)]
    if missing:
        print(
            f"the suite needs {', '.join(missing)}: pip install pytest-rerunfailures redis "
            "pydantic (or run tox -e celery-suite)",
            file=sys.stderr,
        )
        return 2
    suite = fetch_suite(args.cache.resolve())
    out = args.cache.resolve() / "reports"
    out.mkdir(parents=True, exist_ok=True)
    backend_dsn = fresh_database(args.dsn, "celery_suite_results")
    backend = "db+postgresql+psycopg://" + _url_tail(backend_dsn)
    results: dict[str, tuple[dict[str, int], set[str]]] = {}
    for broker in args.brokers.split(","):
        if broker == "pgqueue":
            broker_dsn = fresh_database(args.dsn, "celery_suite_broker")
            url = "pgqueue+postgresql://" + _url_tail(broker_dsn)
        elif broker == "amqp":
            url = args.amqp
        else:
            parser.error(f"unknown broker {broker!r}: pgqueue or amqp")
        fresh_database(args.dsn, "celery_suite_results")  # same backend, empty, for each
        results[broker] = outcomes(run_broker(suite, broker, url, backend, out, args.extra))

    print("\n== summary")
    for broker, (counts, failed) in results.items():
        print(
            f"{broker}: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped"
        )
        for test_id in sorted(failed):
            print(f"  FAILED {test_id}")
    if any(counts["passed"] + counts["failed"] == 0 for counts, _ in results.values()):
        print("no tests ran: see the pytest output above", file=sys.stderr)
        return 2
    if {"pgqueue", "amqp"} <= results.keys():
        only = results["pgqueue"][1] - results["amqp"][1]
        print(f"\nfailing on pgqueue only: {len(only)}")
        for test_id in sorted(only):
            note = "  (expected: by design)" if test_id in EXPECTED_PGQUEUE_ONLY else ""
            print(f"  {test_id}{note}")
        return 1 if only - EXPECTED_PGQUEUE_ONLY else 0
    return 1 if any(failed - EXPECTED_PGQUEUE_ONLY for _, failed in results.values()) else 0


def _url_tail(dsn: str) -> str:
    """user@host:port/dbname of a key=value DSN (no password: trust or .pgpass)."""
    params = conninfo_to_dict(dsn)
    user = params.get("user", "postgres")
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    return f"{user}@{host}:{port}/{params['dbname']}"


def _missing(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return True
    return False


if __name__ == "__main__":
    sys.exit(main())
