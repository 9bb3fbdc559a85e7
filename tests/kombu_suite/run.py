"""Kombu's integration mixins, on pgqueue and on RabbitMQ, side by side.

    python tests/kombu_suite/run.py                     # both brokers
    python tests/kombu_suite/run.py --brokers pgqueue   # one broker
    python tests/kombu_suite/run.py -- -k Priority      # extra pytest arguments
    tox -e kombu-suite

Kombu tests each of its transports with the same classes (``BasicFunctionality``,
``BaseExchangeTypes``, ``BaseTimeToLive``, ``BasePriority``, ``BaseMessage``,
``BaseFailover``, ``BaseEventLoop`` in ``t/integration/common.py``), subclassed once per
transport. The suite comes from the sdist of the installed Kombu version (``pip
download``, kept in ``--cache``); ``tests/kombu_suite/pgqueue_mixins.py`` subclasses every
mixin for a pgqueue connection to a fresh database, and Kombu's own ``test_py_amqp.py``
subclasses the same mixins for RabbitMQ. The failures are then compared by mixin and test:
those that fail on pgqueue only are what this project must fix. Exit status 1 when one
does, 2 when nothing ran.

Needs RabbitMQ for the comparison (``--amqp-host``/``--amqp-port``, default
127.0.0.1:5672) and a PostgreSQL the role may create databases on (``--dsn``, default
``$PGQUEUE_TEST_DSN``). About two minutes: not part of the per-commit CI.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue.embedded import broker_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: suite_runner
import suite_runner  # noqa: E402

HERE = Path(__file__).resolve().parent
MIXINS = (
    "BasicFunctionality",
    "BaseExchangeTypes",
    "TimeToLive",
    "Priority",
    "Failover",
    "Message",
    "EventLoop",
)
#: the test modules, and the prefix of their classes that subclass a mixin
MODULES = {
    "pgqueue": ("test_pgqueue.py", "test_Pgqueue"),
    "amqp": ("test_py_amqp.py", "test_PyAMQP"),
}
NEEDS = ("pytest_rerunfailures",)


def fetch_suite(cache: Path) -> Path:
    import kombu

    root = suite_runner.sdist_tests(
        "kombu",
        kombu.__version__,
        cache,
        lambda path: path.startswith("integration/") or path == "__init__.py",
    )
    # the sdist's pytest settings (setup.cfg) name only t/unit: these are the ones that
    # matter here, with the markers the integration modules use
    (root / "pytest.ini").write_text(
        "[pytest]\npython_classes = test_*\nmarkers =\n    env\n    flaky\n"
    )
    # this project's module, fresh on every run (it changes with this project)
    shutil.copyfile(HERE / "pgqueue_mixins.py", root / "t" / "integration" / "test_pgqueue.py")
    return root


def run_broker(suite: Path, broker: str, env: dict[str, str], out: Path, extra: list[str]) -> Path:
    module, prefix = MODULES[broker]
    # the classes that subclass a mixin; a module's transport-specific tests are not compared
    args = ["-p", "no:randomly", f"t/integration/{module}"]
    args += ["-k", " or ".join(prefix + m for m in MIXINS), *extra]
    return suite_runner.run_pytest(suite, broker, args, env, out)


def outcomes(report: Path, prefix: str) -> tuple[dict[str, int], set[str]]:
    """(counts by outcome, "Mixin::test" of the tests that failed or errored). A test the
    flaky marker ran again appears more than once: its last outcome counts."""
    last: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{re.sub('^' + prefix, '', cls)}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            last[test_id] = "failed"
        elif case.find("skipped") is not None:
            last[test_id] = "skipped"
        else:
            last[test_id] = "passed"
    counts = {k: sum(1 for v in last.values() if v == k) for k in ("passed", "failed", "skipped")}
    return counts, {test_id for test_id, v in last.items() if v == "failed"}


def main() -> int:
    parser = suite_runner.parser(__doc__, ".kombu-suite")
    parser.add_argument("--amqp-host", default="127.0.0.1")
    parser.add_argument("--amqp-port", default="5672")
    args = parser.parse_args()

    missing = suite_runner.missing(NEEDS)
    if missing:
        print(
            f"the suite needs {', '.join(missing)}: pip install pytest-rerunfailures "
            "(or run tox -e kombu-suite)",
            file=sys.stderr,
        )
        return 2
    suite = fetch_suite(args.cache.resolve())
    out = args.cache.resolve() / "reports"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, suite_runner.Outcomes] = {}
    for broker in args.brokers.split(","):
        if broker == "pgqueue":
            # with its port, which BaseFailover's list needs on every URL (the product
            # refuses a failover list that gives a port on some URLs only)
            params = conninfo_to_dict(suite_runner.fresh_database(args.dsn, "kombu_suite_broker"))
            url = broker_url(make_conninfo(**{"port": "5432", **params}))
            env = dict(os.environ, PGQUEUE_SUITE_URL=url)
        elif broker == "amqp":
            env = dict(os.environ, RABBITMQ_HOST=args.amqp_host, RABBITMQ_5672_TCP=args.amqp_port)
        else:
            parser.error(f"unknown broker {broker!r}: pgqueue or amqp")
        report = run_broker(suite, broker, env, out, args.extra)
        results[broker] = outcomes(report, MODULES[broker][1])
    return suite_runner.compare(results)


if __name__ == "__main__":
    sys.exit(main())
