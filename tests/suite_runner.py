"""What the runners of Kombu's and Celery's own suites share (tests/kombu_suite/run.py,
tests/celery_suite/run.py): the suite's tests from the installed version's sdist, fresh
databases, the command line, and the comparison of the brokers' failures.

Each runner runs the upstream suite once per broker with pytest's JUnit report, reads the
report its own way (the two suites name their tests differently) and hands
``{broker: (counts by outcome, ids of the tests that failed)}`` to :func:`compare`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: counts by outcome ("passed", "failed", "skipped") and the ids of the failed tests
Outcomes = tuple[dict[str, int], set[str]]


def parser(doc: str | None, cache: str) -> argparse.ArgumentParser:
    """The options both runners take: --brokers, --dsn, --cache and pytest's own after
    ``--``."""
    made = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    made.add_argument("--brokers", default="pgqueue,amqp")
    made.add_argument(
        "--dsn",
        default=os.environ.get("PGQUEUE_TEST_DSN")
        or "host=127.0.0.1 dbname=postgres user=postgres",
    )
    made.add_argument("--cache", type=Path, default=Path(cache))
    made.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    return made


def missing(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here."""
    absent = []
    for module in modules:
        try:
            __import__(module)
        except ImportError:
            absent.append(module)
    return absent


def sdist_tests(package: str, version: str, cache: Path, keep: Callable[[str], bool]) -> Path:
    """The sdist of ``package``==``version``'s members under ``t/`` that ``keep`` takes
    (by their path from ``t/``), extracted once into ``cache``; the folder holding ``t``.
    Only the tests: the sdist's own package beside them would shadow the installed one."""
    root = cache / f"{package}-{version}-tests"
    if (root / "t" / "integration").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--no-binary", ":all:", "--dest", str(cache), f"{package}=={version}"],
        check=True,
    )
    prefix = f"{package}-{version}/t/"
    with tarfile.open(cache / f"{package}-{version}.tar.gz") as archive:
        members = [
            m
            for m in archive.getmembers()
            if m.name.startswith(prefix) and keep(m.name.removeprefix(prefix))
        ]
        for member in members:
            member.name = member.name.removeprefix(f"{package}-{version}/")
        archive.extractall(root, members=members, filter="data")
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


def run_pytest(
    suite: Path, broker: str, args: list[str], env: Mapping[str, str], out: Path
) -> Path:
    """pytest ``args`` in ``suite`` for ``broker``, without this project's plugin and with
    a JUnit report; the report's path."""
    report = out / f"{broker}.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:pgqueue"]
    command += ["--junitxml", str(report), "-q", "-o", "addopts=", *args]
    print(f"\n== {broker}: {' '.join(command[2:])}", flush=True)
    started = time.monotonic()
    subprocess.run(command, cwd=suite, env=dict(env), check=False)
    print(f"== {broker}: {time.monotonic() - started:.0f} s", flush=True)
    return report


def compare(results: Mapping[str, Outcomes], expected: Collection[str] = ()) -> int:
    """Print each broker's counts and failures, and those failing on pgqueue only; the
    exit status: 2 when a broker ran nothing, 1 when a test other than ``expected``
    fails on pgqueue only (on pgqueue at all, without RabbitMQ to compare), else 0."""
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
    failing = results["pgqueue"][1] if "pgqueue" in results else set()
    if {"pgqueue", "amqp"} <= results.keys():
        failing = failing - results["amqp"][1]
        print(f"\nfailing on pgqueue only: {len(failing)}")
        for test_id in sorted(failing):
            note = "  (expected: by design)" if test_id in expected else ""
            print(f"  {test_id}{note}")
    return 1 if set(failing) - set(expected) else 0
