"""pytest-celery's own suite (its v1.3.0 tag's ``tests/``) on pgqueue nodes, no Docker.

    python tests/pytest_celery/suite/run.py [--source URL|TARBALL|GIT_DIR] [--workdir DIR]
        [-- pytest args]

(``tox -e pytest-celery`` runs it after the adapter's tests.) Steps:

1. Get the suite. The sdist on PyPI has no tests, so the source is the tag's tarball
   from GitHub (the default ``--source``), a tarball already downloaded, or a git clone
   or mirror holding the tag (``git archive v1.3.0``). If none can be had the runner
   stops and says what failed.
2. Put pgqueue's nodes in: ``pgqueue_suite.py`` beside the suite, a root ``conftest.py``
   that loads ``celery_pgqueue.pytest_celery`` (and, from ``pgqueue_suite``, the hook that
   skips the container-only tests, each with its reason), and an import appended to each
   conftest that redefines a container fixture (a conftest's fixture beats a plugin's).
   The suite's test files are not touched, except ``tests/smoke/test_failover.py``, which
   defines its RabbitMQ broker cluster in the test module itself.
3. Run pytest over the whole ``tests/`` with Docker unreachable (``DOCKER_HOST`` points
   at no socket, so a test that still reached Docker would error, not start
   containers), and print the outcome per directory.

Needs ``redis`` and ``python-memcached`` installed (the suite's modules import them) and
a PostgreSQL (``PGQUEUE_TEST_DSN``); the failover test also starts a throwaway cluster
(``tests/clusters.py``: PostgreSQL's server binaries).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from collections import Counter
from pathlib import Path

TAG = "v1.3.0"
TARBALL = f"https://github.com/celery/pytest-celery/archive/refs/tags/{TAG}.tar.gz"
HERE = Path(__file__).resolve().parent
PROJECT_TESTS = HERE.parents[1]

ROOT_CONFTEST = '''\
"""Written by kombu-pgqueue's tests/pytest_celery/suite/run.py: pgqueue nodes."""

from pgqueue_suite import pytest_collection_modifyitems  # noqa: F401

pytest_plugins = ("celery_pgqueue.pytest_celery",)
'''

#: file of the suite -> the names it takes from pgqueue_suite (or the lines it gains)
APPENDED: dict[str, str] = {
    "tests/integration/conftest.py": "from pgqueue_suite import default_worker_container\n",
    "tests/smoke/conftest.py": (
        "from pgqueue_suite import default_worker_container, worker_of\n\n"
        'celery_latest_worker = worker_of(CeleryLatestWorkerContainer, "celery_latest_worker")\n'
    ),
    "tests/integration/api/custom_setup/conftest.py": (
        "from pgqueue_suite import default_worker_container, worker_of\n\n"
        'celery4_worker = worker_of(Celery4WorkerContainer, "celery4_worker")\n'
    ),
    "tests/smoke/test_failover.py": "from pgqueue_suite import celery_broker_cluster\n",
}
MARK = "\n\n# -- pgqueue nodes, appended by kombu-pgqueue's tests/pytest_celery/suite/run.py --\n"


def fetch(source: str, dest: Path) -> None:
    """Unpack the tag's ``tests/`` and ``pyproject.toml`` from ``source`` into ``dest``."""
    if Path(source).is_dir():
        out = subprocess.run(
            ["git", "--git-dir", _git_dir(Path(source)), "archive", TAG, "tests", "pyproject.toml"],
            capture_output=True,
            check=False,
        )
        if out.returncode:
            sys.exit(f"git archive {TAG} in {source} failed: {out.stderr.decode().strip()}")
        data = out.stdout
        strip = 0
    elif Path(source).is_file():
        data = Path(source).read_bytes()
        strip = 1
    else:
        try:
            with urllib.request.urlopen(source, timeout=60) as reply:
                data = reply.read()
        except OSError as exc:
            sys.exit(
                f"could not download {source}: {exc}\n"
                "pytest-celery's sdist has no tests; give the tag another way: "
                "--source <a clone or mirror of github.com/celery/pytest-celery holding "
                f"{TAG}> or --source <its tag tarball>"
            )
        strip = 1
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts[strip:]
            if not parts or parts[0] not in ("tests", "pyproject.toml"):
                continue
            member.name = str(Path(*parts))
            tar.extract(member, dest, filter="data")
    version = (dest / "pyproject.toml").read_text()
    if f'version = "{TAG[1:]}"' not in version:
        sys.exit(f"{source} is not pytest-celery {TAG}")


def _git_dir(path: Path) -> str:
    return str(path / ".git") if (path / ".git").exists() else str(path)


def install_nodes(suite: Path) -> None:
    shutil.copy(HERE / "pgqueue_suite.py", suite / "pgqueue_suite.py")
    (suite / "conftest.py").write_text(ROOT_CONFTEST)
    for name, lines in APPENDED.items():
        path = suite / name
        path.write_text(path.read_text() + MARK + lines)


def run(suite: Path, pytest_args: list[str]) -> int:
    env = {
        **os.environ,
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",
        "PGQUEUE_PROJECT_TESTS": str(PROJECT_TESTS),
        "PGQUEUE_TEST_DSN": os.environ.get(
            "PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres"
        ),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-o",
        "addopts=",  # the suite's own: coverage and --capture=no
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "--timeout",
        "300",
        "--junitxml",
        str(suite / "results.xml"),
        *pytest_args,
    ]
    print("+", " ".join(command), f"(in {suite})", flush=True)
    return subprocess.run(command, cwd=suite, env=env, check=False).returncode


def summary(suite: Path) -> None:
    """Outcomes per directory, from the JUnit XML."""
    import xml.etree.ElementTree as ET

    counts: dict[str, Counter[str]] = {}
    for case in ET.parse(suite / "results.xml").iter("testcase"):
        parts = [*case.get("classname", "").split("."), ""]  # "" for pytest's own errors
        depth = 3 if parts[1:2] == ["integration"] else 2  # tests/integration/api, tests/smoke
        directory = "/".join(parts[: 1 if parts[1].startswith("test_") else depth])
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors"}.get(child.tag, child.tag)
                if child.tag == "skipped" and "xfail" in (child.get("type") or ""):
                    outcome = "xfailed"
        counts.setdefault(directory, Counter())[outcome] += 1
    columns = ("passed", "failed", "errors", "xfailed", "skipped")
    print("\n| directory | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for directory, c in sorted(counts.items()):
        print(f"| `{directory}` | " + " | ".join(str(c[k]) for k in columns) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--source", default=TARBALL, help="tag tarball URL or file, or git dir")
    parser.add_argument("--workdir", type=Path, help="where to unpack (default: a temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pytest-celery-suite-"))
    suite = workdir / "pytest-celery"
    if suite.exists():
        shutil.rmtree(suite)
    suite.mkdir(parents=True)
    fetch(args.source, suite)
    install_nodes(suite)
    code = run(suite, args.pytest_args)
    if (suite / "results.xml").exists():
        summary(suite)
    return code


if __name__ == "__main__":
    sys.exit(main())
