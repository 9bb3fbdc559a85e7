"""Celery on pgqueue: one DSN for broker and results, and the ``celery pgqueue`` CLI.

.. code-block:: python

    from celery import Celery
    import celery_pgqueue

    app = Celery("proj")
    celery_pgqueue.configure(app, "postgresql://app@db.internal/app")
"""

from __future__ import annotations

from typing import Any

import kombu_pgqueue  # noqa: F401 - registers the pgqueue:// transport alias
from kombu_pgqueue import __version__  # one distribution, one version
from kombu_pgqueue.embedded import broker_url

__all__ = ["__version__", "broker_url", "configure", "result_backend_url"]


def result_backend_url(dsn: str) -> str:
    """Celery's SQLAlchemy result backend URL (psycopg 3 driver) for ``dsn``."""
    from psycopg.conninfo import conninfo_to_dict
    from sqlalchemy.engine import URL

    params: dict[str, Any] = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    port = params.pop("port", None)
    if "," in params.get("host", ""):
        # several hosts (libpq's failover): SQLAlchemy takes them as host=h:p, repeated
        hosts = params["host"].split(",")
        ports = (port or "").split(",")
        ports = ports * len(hosts) if len(ports) == 1 else ports
        params["host"] = tuple(f"{h}:{p}" if p else h for h, p in zip(hosts, ports))
        port = None
    url = URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        port=int(port) if port else None,
        database=params.pop("dbname", None),
        query=params,
    )
    return "db+" + url.render_as_string(hide_password=False)


def configure(
    app: Any,
    dsn: str,
    *,
    results: bool = True,
    **transport_options: Any,
) -> None:
    """Point ``app``'s broker (and, unless ``results=False``, its result backend) at ``dsn``.

    ``transport_options`` are pgqueue's (``schema``, ``visibility_timeout``,
    ``max_attempts``, ...; see :mod:`kombu_pgqueue.transport`).
    """
    conf = app.conf
    conf.broker_url = broker_url(dsn)
    conf.broker_transport_options = {
        **dict(conf.broker_transport_options or {}),
        **transport_options,
    }
    conf.broker_connection_retry_on_startup = True
    if results:
        conf.result_backend = result_backend_url(dsn)
        conf.result_extended = True
