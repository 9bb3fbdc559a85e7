"""pytest-celery 1.3 on pgqueue: broker, result backend and workers without Docker.

Opt in from the root ``conftest.py`` (it imports pytest-celery, which imports Docker's
client, so it is not loaded by the ``pgqueue`` entry point)::

    pytest_plugins = ("celery_pgqueue.pytest_celery",)

and ``celery_setup`` then runs on:

* a broker node (``celery_pgqueue_broker``, also ``celery_broker``): this test's schema
  on the plugin's PostgreSQL (``pgqueue_dsn``: ``--pgqueue-dsn``, ``PGQUEUE_TEST_DSN``
  or an embedded server), its URL ``pgqueue://...``;
* a result-backend node (``celery_pgqueue_backend``, also ``celery_backend``): Celery's
  database backend on the same server, its tables in the test's schema;
* a worker node (``celery_setup_worker``, and ``celery_pgqueue_worker`` for a second one
  in a cluster): a real ``celery worker`` process built from pytest-celery's own
  ``default_worker_*`` fixtures (app module, tasks, signals, env, command, container
  class), its files written where a container would mount them, run from there.

``celery_setup_config`` gains the settings pytest-celery does not carry (the schema in
``broker_transport_options``, the result tables' schema) from ``pgqueue_celery_config``;
they reach the worker through pytest-celery's generated ``app.py``.

A node is what pytest-celery's ``CeleryTestNode`` wraps: an object with the few
container methods it calls (``celeryconfig``, ``ready``, ``logs``, ``name``, ``id``,
``status``, ``kill``, ``restart``, ``reload``, ``teardown``; a worker also ``version``,
``log_level``, ``worker_name``, ``worker_queue``, ``exec_run``). pytest-celery does not
document that surface, hence the pin ``pytest-celery>=1.3,<1.4``. See docs/testing.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import psycopg
import pytest
from pytest_celery import (
    DEFAULT_WORKER_CONTAINER_TIMEOUT,
    CeleryTestBackend,
    CeleryTestBroker,
    CeleryTestWorker,
)

import kombu_pgqueue  # noqa: F401 - registers pgqueue:// in the test process

#: the worker's entry: ``celery`` with the pgqueue:// alias registered first (the
#: generated app.py imports only celery and the task modules)
BOOT = (
    "import sys, kombu_pgqueue; from celery.__main__ import main; "
    "sys.argv[0] = 'celery'; sys.exit(main())"
)
#: what the messages ask a user to add
LOAD_LINE = 'pytest_plugins = ("celery_pgqueue.pytest_celery",)'


def is_pgqueue_url(url: str) -> bool:
    return url.partition("://")[0].split("+")[0] == "pgqueue"


class PgqueueServer:
    """A broker or backend "container": the test's database, reached by URL.

    As with a docker-py container, ``status`` is what the last ``reload()`` saw: a node
    killed with ``reload_container=False`` still reads "running".
    """

    def __init__(self, dsn: str, url: str, role: str) -> None:
        self.dsn = dsn
        self.url = url
        self.id = uuid.uuid4().hex
        self.name = f"pgqueue-{role}-{self.id[:12]}"
        self.running = True  # kill() and restart() set it; reload() copies it to status
        self.status = "running"

    @property
    def celeryconfig(self) -> dict[str, str]:
        # the test process and the worker process reach the server by the same address
        return {"url": self.url, "host_url": self.url}

    def ready(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
        return True

    def logs(self) -> str:
        return ""

    def kill(self, signal: str | int | None = "SIGKILL") -> None:
        # the server is shared by every test of the session: it is not stopped (a node
        # that really stops is a subclass over a server of its own)
        self.running = False

    def restart(self, timeout: float | None = None) -> None:
        self.running = True

    def reload(self) -> None:
        self.status = "running" if self.running else "exited"

    def teardown(self) -> None:
        pass  # pgqueue_schema drops the test's schema, results and all


class PgqueueTestBroker(CeleryTestBroker):  # type: ignore[misc]  # pytest-celery is untyped
    """pytest-celery broker node on pgqueue."""


class PgqueueTestBackend(CeleryTestBackend):  # type: ignore[misc]
    """pytest-celery result-backend node on Celery's database backend."""


class LocalWorker:
    """A worker "container": a ``celery worker`` process in a directory of its own.

    The directory holds what pytest-celery would put in the worker's volume
    (``default_worker_initial_content``); the command is ``default_worker_command``
    with ``celery`` run by this Python and ``%h`` replaced by this node's id, so the
    node's ``hostname()`` (``name@id[:12]``) is the worker's name.
    """

    def __init__(
        self,
        container_cls: Any,
        content: dict[str, bytes],
        env: dict[str, str],
        command: list[str],
        root: Path,
    ) -> None:
        self.container_cls = container_cls
        self.id = uuid.uuid4().hex
        self.name = f"pgqueue-worker-{self.id[:12]}"
        self.root = root / self.name
        self.root.mkdir(parents=True)
        for path, data in content.items():
            target = self.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = {
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([str(self.root), *inherited]),
        }
        if command[:1] != ["celery"]:
            raise ValueError(f"default_worker_command must start with 'celery': {command}")
        args = [arg.replace("%h", self.id[:12]) for arg in command[1:]]
        self.command = [sys.executable, "-c", BOOT, *args]
        self.log_path = self.root / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()
        self.status = "running"  # what the last reload() saw, as docker-py's status

    def __getattr__(self, name: str) -> Any:
        # the vendor class's classmethods (app_module(), command(), ...), as on the
        # container pytest-celery would have made from it
        if name.startswith("__") or name == "container_cls":
            raise AttributeError(name)
        return getattr(self.container_cls, name)

    @property
    def client(self) -> LocalWorker:
        return self  # as pytest-celery's own worker containers answer

    @property
    def celeryconfig(self) -> dict[str, str]:
        raise NotImplementedError  # a worker has no URL (CeleryWorkerContainer's answer)

    # -- the process ----------------------------------------------------------------
    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self, timeout: float = DEFAULT_WORKER_CONTAINER_TIMEOUT) -> bool:
        """Wait for the worker's ``ready.`` line; fail with its log if it exits first."""
        assert self.proc is not None
        found = getattr(self.container_cls, "ready_prompt", "ready.")
        prompt = str(found.__get__(self) if isinstance(found, property) else found)
        deadline = time.monotonic() + timeout
        while prompt not in self.logs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{self.logs()[-3000:]}")
            try:
                self.proc.wait(timeout=0.1)  # the wait is also the check that it still runs
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(
                f"{self.name} exited ({self.proc.returncode}) before it was ready:\n"
                f"{self.logs()[-3000:]}"
            )
        return True

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, signal: str | int | None = "SIGKILL") -> None:
        """Signal the worker's process group (pool children too) and wait for it."""
        number = signal if isinstance(signal, int) else _signal_number(signal or "SIGKILL")
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, number)
        self.proc.wait(timeout=DEFAULT_WORKER_CONTAINER_TIMEOUT)

    def restart(self, timeout: float | None = None) -> None:
        """As ``docker restart``: stop (SIGTERM, SIGKILL after ``timeout``), start."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout or 10)
            except subprocess.TimeoutExpired:
                self.kill("SIGKILL")
        self.start()

    def reload(self) -> None:
        self.status = "running" if self.running() else "exited"

    def teardown(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=DEFAULT_WORKER_CONTAINER_TIMEOUT)

    def exec_run(self, cmd: str | list[str], **_: Any) -> tuple[int, bytes]:
        """Run ``cmd`` in the worker's directory and environment (not in its process)."""
        done = subprocess.run(
            cmd,
            shell=isinstance(cmd, str),
            cwd=self.root,
            env=self.env,
            capture_output=True,
            timeout=DEFAULT_WORKER_CONTAINER_TIMEOUT,
        )
        return done.returncode, done.stdout + done.stderr

    # -- what CeleryTestWorker asks of its container ------------------------------------
    def version(self) -> str:
        return str(celery.__version__)

    def log_level(self) -> str:
        return str(self.container_cls.log_level())

    def worker_name(self) -> str:
        return str(self.container_cls.worker_name())

    def worker_queue(self) -> str:
        return str(self.container_cls.worker_queue())


def _signal_number(name: str) -> int:
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


# -- fixtures ---------------------------------------------------------------------------
@pytest.fixture
def celery_pgqueue_broker(pgqueue_dsn: str, pgqueue_broker_url: str) -> Iterator[Any]:
    """A pgqueue broker node on this test's schema."""
    broker = PgqueueTestBroker(PgqueueServer(pgqueue_dsn, pgqueue_broker_url, "broker"))
    yield broker
    broker.teardown()


@pytest.fixture
def celery_pgqueue_backend(pgqueue_dsn: str) -> Iterator[Any]:
    """A result-backend node: Celery's database backend on the plugin's server."""
    from celery_pgqueue import result_backend_url

    url = result_backend_url(pgqueue_dsn)
    backend = PgqueueTestBackend(PgqueueServer(pgqueue_dsn, url, "backend"))
    yield backend
    backend.teardown()


@pytest.fixture
def celery_broker(celery_pgqueue_broker: Any) -> Any:
    """pytest-celery's broker fixture (all its brokers, by default): pgqueue only."""
    return celery_pgqueue_broker


@pytest.fixture
def celery_backend(celery_pgqueue_backend: Any) -> Any:
    """pytest-celery's backend fixture: the pgqueue database backend only."""
    return celery_pgqueue_backend


def local_worker(
    request: pytest.FixtureRequest, root: Path, container_cls: Any = None
) -> LocalWorker:
    """A ready worker process built from the test's ``default_worker_*`` fixtures.

    ``container_cls`` (default: ``default_worker_container_cls``) names the worker and
    its queue, as a vendor class does for a container: a second worker of another class
    takes that class's ``command()`` (the test's ``default_worker_command`` belongs to
    the default worker).
    """
    value = request.getfixturevalue
    app = value("default_worker_app")
    if hasattr(app.backend, "ResultSession"):
        # the result tables, made here once: the test's first result and the worker's
        # would otherwise race to create them (a unique violation in pg_type)
        app.backend.ResultSession().close()
    if container_cls is None:
        container_cls = value("default_worker_container_cls")
        command = list(value("default_worker_command"))
    else:
        command = list(container_cls.command())
    node = LocalWorker(
        container_cls=container_cls,
        content=value("default_worker_initial_content"),
        env=value("default_worker_env"),
        command=command,
        root=root,
    )
    try:
        node.ready()
    except BaseException:
        node.teardown()
        raise
    return node


@pytest.fixture
def default_worker_container(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """pytest-celery's worker container: here a local ``celery worker`` process."""
    node = local_worker(request, tmp_path)
    yield node
    node.teardown()


@pytest.fixture
def celery_setup_worker(
    default_worker_cls: Any, default_worker_container: LocalWorker, default_worker_app: Any
) -> Iterator[Any]:
    """pytest-celery's worker (what ``celery_worker`` returns): a local process."""
    worker: CeleryTestWorker = default_worker_cls(
        container=default_worker_container, app=default_worker_app
    )
    yield worker
    worker.teardown()


@pytest.fixture
def celery_pgqueue_worker(
    request: pytest.FixtureRequest, tmp_path: Path, default_worker_cls: Any
) -> Iterator[Any]:
    """Another worker process like ``celery_setup_worker``, for a cluster of two."""
    node = local_worker(request, tmp_path)
    worker: CeleryTestWorker = default_worker_cls(
        container=node, app=request.getfixturevalue("default_worker_app")
    )
    yield worker
    worker.teardown()


@pytest.fixture
def celery_setup_config(
    celery_setup_config: dict[str, Any], pgqueue_celery_config: dict[str, Any]
) -> dict[str, Any]:
    """pytest-celery's URLs, and pgqueue's schema for the broker and the results."""
    urls = str(celery_setup_config.get("broker_url") or "").split(";")
    # no URL at all is a setup without a broker cluster (celery_broker_cluster = None)
    strangers = [url for url in urls if url and not is_pgqueue_url(url)]
    if strangers:
        pytest.fail(
            f"celery_pgqueue.pytest_celery: the broker cluster holds {strangers[0]!r}, not a "
            "pgqueue node: build celery_broker_cluster from celery_pgqueue_broker nodes (or "
            f"remove {LOAD_LINE} to run pytest-celery's own containers)",
            pytrace=False,
        )
    config = {**pgqueue_celery_config, **celery_setup_config}
    # results go to the database backend only if the cluster has our backend node
    if not str(config.get("result_backend", "")).startswith("db+"):
        for key in ("database_table_schemas", "database_short_lived_sessions"):
            config.pop(key, None)
    return config


@pytest.fixture
def default_worker_app(default_worker_app: Any, celery_setup_config: dict[str, Any]) -> Any:
    """The setup's app, its settings marked as changes: the worker's generated app.py
    holds only ``app.conf.changes`` (a dict given to ``config_from_object`` is not one),
    and the URLs alone would leave the worker on another schema than the test."""
    default_worker_app.conf.update(celery_setup_config)
    return default_worker_app
