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

import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: suite_runner
import suite_runner  # noqa: E402

FILES = ("test_tasks.py", "test_inspect.py", "test_canvas.py")
#: fails on pgqueue by design (docs/migrating.md: `celery inspect scheduled`)
EXPECTED_PGQUEUE_ONLY = {"t/integration/test_inspect.py::test_Inspect::test_scheduled"}
#: what the suite imports beyond this project's test extra
NEEDS = ("pytest_rerunfailures", "redis", "pydantic")
MARKERS = ("sleepdeprived_patched_module", "masked_modules", "patched_environ", "patched_module")
MARKERS += ("flaky", "timeout", "amqp")


def fetch_suite(cache: Path) -> Path:
    import celery

    root = suite_runner.sdist_tests("celery", celery.__version__, cache, lambda path: True)
    # the sdist's pytest settings (pyproject.toml), which stayed behind with celery/
    (root / "pytest.ini").write_text(
        "[pytest]\npython_classes = test_*\nxfail_strict = true\nmarkers =\n"
        + "".join(f"    {marker}\n" for marker in MARKERS)
    )
    return root


def run_broker(
    suite: Path, broker: str, broker_url: str, backend: str, out: Path, extra: list[str]
) -> Path:
    env = dict(os.environ, TEST_BROKER=broker_url, TEST_BACKEND=backend)
    # registers the pgqueue:// scheme in the test process (the worker runs in it)
    args = ["-p", "kombu_pgqueue", "-p", "celery.contrib.pytest"]
    args += [f"t/integration/{name}" for name in FILES] + extra
    return suite_runner.run_pytest(suite, broker, args, env, out)


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
    parser = suite_runner.parser(__doc__, ".celery-suite")
    parser.add_argument("--amqp", default="pyamqp://guest:guest@127.0.0.1:5672//")
    args = parser.parse_args()

    missing = suite_runner.missing(NEEDS)
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
    backend_dsn = suite_runner.fresh_database(args.dsn, "celery_suite_results")
    backend = "db+postgresql+psycopg://" + _url_tail(backend_dsn)
    results: dict[str, suite_runner.Outcomes] = {}
    for broker in args.brokers.split(","):
        if broker == "pgqueue":
            broker_dsn = suite_runner.fresh_database(args.dsn, "celery_suite_broker")
            url = "pgqueue+postgresql://" + _url_tail(broker_dsn)
        elif broker == "amqp":
            url = args.amqp
        else:
            parser.error(f"unknown broker {broker!r}: pgqueue or amqp")
        # the same backend, empty, for each
        suite_runner.fresh_database(args.dsn, "celery_suite_results")
        results[broker] = outcomes(run_broker(suite, broker, url, backend, out, args.extra))
    return suite_runner.compare(results, EXPECTED_PGQUEUE_ONLY)


def _url_tail(dsn: str) -> str:
    """user@host:port/dbname of a key=value DSN (no password: trust or .pgpass)."""
    params = conninfo_to_dict(dsn)
    user = params.get("user", "postgres")
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    return f"{user}@{host}:{port}/{params['dbname']}"


if __name__ == "__main__":
    sys.exit(main())
