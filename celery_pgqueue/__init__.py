"""Celery on pgqueue: one DSN for broker and results, and the ``celery pgqueue`` CLI.

.. code-block:: python

    from celery import Celery
    import celery_pgqueue

    app = Celery("proj")
    celery_pgqueue.configure(app, "postgresql://app@db.internal/app")

Importing the package connects the failed-task archive's ``task_failure`` receiver
(:mod:`celery_pgqueue.archive`), which does nothing unless an app turns it on
(``configure()`` does), and a ``worker_init`` receiver (:mod:`celery_pgqueue._worker`):
the broker's schema is installed before Celery creates result tables in it, a solo
worker (its event loop runs its tasks) takes no handoffs, and the worker's sweep trims
the failed tasks kept.
"""

from __future__ import annotations

from typing import Any

import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// transport alias
from kombu_pgqueue import __version__  # one distribution, one version
from kombu_pgqueue.admin import conninfo
from kombu_pgqueue.embedded import broker_url
from kombu_pgqueue.exceptions import ConfigurationError

from . import (
    _results_pool,
    _worker,  # noqa: F401 - connects its worker_init receiver
    archive,
)
from ._worker import SchemaFirst, tables_on_first_use
from .atomic import AtomicTask

__all__ = ["AtomicTask", "__version__", "broker_url", "configure", "result_backend_url"]


def result_backend_url(dsn: str) -> str:
    """Celery's SQLAlchemy result backend URL (psycopg 3 driver) for ``dsn``, a libpq URL
    or key=value string.

    One host goes where URLs put it (``user@host:port/db``); a Unix socket directory and
    several hosts (libpq's failover), which a URL's host cannot hold, go in the query
    string as SQLAlchemy's psycopg dialect reads them.
    """
    from psycopg.conninfo import conninfo_to_dict
    from sqlalchemy.engine import URL

    params: dict[str, Any] = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    host = params.pop("host", None)
    port = params.pop("port", None)
    if host and "," in host:
        # several hosts: SQLAlchemy takes them as host=h:p, repeated
        hosts = host.split(",")
        ports = (port or "").split(",")
        ports = ports * len(hosts) if len(ports) == 1 else ports
        params["host"] = tuple(f"{h}:{p}" if p else h for h, p in zip(hosts, ports))
        host = port = None
    elif host and host.startswith("/"):
        # a socket directory (libpq: any host starting with a slash); its port names the
        # socket file, and an empty host with a port would read as ":5432" in the URL
        params["host"] = host
        if port:
            params["port"] = port
        host = port = None
    url = URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        host=host or None,
        port=int(port) if port else None,
        database=params.pop("dbname", None),
        query=params,
    )
    return "db+" + url.render_as_string(hide_password=False)


def _is_broker_url(url: str) -> bool:
    return url.partition("://")[0].split("+")[0] == "pgqueue"


def configure(
    app: Any,
    dsn: str,
    *,
    results: bool = True,
    keep_failed: bool | None = None,
    **transport_options: Any,
) -> None:
    """Point ``app``'s broker (and, unless ``results=False``, its result backend) at ``dsn``.

    ``dsn`` is a libpq URL or key=value string, or a ``pgqueue://`` broker URL (also
    ``pgqueue+postgresql://...`` and a failover list ``pgqueue://a/db;pgqueue://b/db``,
    whose first URL then holds the results). ``transport_options`` are pgqueue's
    (``schema``, ``visibility_timeout``, ``max_attempts``, ...; see
    docs/configuration.md, "Transport options"); libpq keywords among them (``sslmode``, ...) apply
    to the results' connections too. Tasks that fail for good are kept in the dead
    letters for 7 days (the settings ``pgqueue_keep_failed`` and
    ``pgqueue_keep_failed_for``; see :mod:`celery_pgqueue.archive`):
    ``keep_failed=False`` turns that off, and None (the default) turns it on unless the
    app set ``pgqueue_keep_failed`` itself.

    The result tables are created on first use (``database_create_tables_at_setup``
    False, unless the app set it): a process started before its database then waits
    for it, or follows its publish retry policy, instead of failing as the backend is
    made.
    """
    conf = app.conf
    conf.broker_url = dsn if _is_broker_url(dsn) else _broker_url_of(dsn)
    conf.broker_transport_options = {
        **dict(conf.broker_transport_options or {}),
        **transport_options,
    }
    conf.broker_connection_retry_on_startup = True
    if results:
        results_conninfo = _results_conninfo(dsn, transport_options)
        conf.result_backend = result_backend_url(results_conninfo)
        # its sessions from one small pool per process, closed when idle (_results_pool)
        conf.database_engine_options = _results_pool.engine_options(
            results_conninfo, conf.database_engine_options, transport_options
        )
        conf.result_extended = True
        # a web process makes the backend at its first delay(), before the publish, and
        # a database not up yet then failed the call before its retry policy began
        tables_on_first_use(conf)
        # result tables placed in the broker's schema: that schema first (see _worker)
        found = conf.database_engine_callback
        if isinstance(found, SchemaFirst):  # configured again, or conf copied from an app
            found = found.previous
        conf.database_engine_callback = SchemaFirst(app, found)
    if keep_failed is not None:
        conf[archive.SETTING] = keep_failed
    elif not conf.value_set_for(archive.SETTING):
        conf[archive.SETTING] = True


def _broker_url_of(dsn: str) -> str:
    """The ``pgqueue://`` URL of libpq DSN ``dsn``; a URL of another scheme (another
    broker's) is refused in one line."""
    scheme = dsn.partition("://")[0].lower() if "://" in dsn else None
    if scheme not in (None, "postgresql", "postgres"):
        from kombu.utils.url import maybe_sanitize_url

        raise ConfigurationError(
            "configure() takes a PostgreSQL DSN (postgresql://... or host=... dbname=...) "
            f"or a pgqueue:// broker URL, not {maybe_sanitize_url(dsn)!r}"
        )
    return broker_url(dsn)


def _results_conninfo(dsn: str, transport_options: dict[str, Any]) -> str:
    """The libpq string of ``dsn`` for the results: as the transport connects, without the
    session keywords the transport adds to a broker URL's (its application_name names
    the broker's pool in the configuring process, its connect_timeout is its own)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    found = conninfo(dsn, **transport_options)
    if not _is_broker_url(dsn):
        return found
    params = conninfo_to_dict(found)
    for key in ("application_name", "connect_timeout"):
        if key not in transport_options:
            params.pop(key, None)
    return make_conninfo("", **params)
