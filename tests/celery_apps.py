"""The one factory of the tests' Celery apps: a pgqueue broker on a test schema.

``celery_app(dsn, schema)`` is the app of the ``app`` fixture (``tests/conftest.py``);
every other app a test builds (a second client, the app of ``celery worker``/``celery
beat``/``flower`` processes, a producer that is killed) comes from here too, with
keyword options for what differs:

* ``results``: the result backend on the same database (``False``: none);
* ``conf``: Celery settings over :data:`CONF`;
* any other keyword: a pgqueue transport option over :data:`TRANSPORT_OPTIONS`.

Worker processes import it as the tests do: their ``PYTHONPATH`` includes ``tests/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery

import celery_pgqueue

#: transport options every test app starts from: quick safety polls, short leases
TRANSPORT_OPTIONS: dict[str, Any] = {"polling_interval": 0.5, "visibility_timeout": 10}

#: Celery settings every test app starts from
CONF: dict[str, Any] = {
    "task_default_queue": "celery",
    # an in-process worker leaves pytest's logging alone; processes that print their
    # log for the tests to read pass True
    "worker_hijack_root_logger": False,
    "broker_connection_retry_on_startup": True,
    "result_backend_always_retry": False,
    # results from other tests' schemas share the table; ids are unique anyway
    "database_short_lived_sessions": True,
}


def celery_app(
    dsn: str,
    schema: str,
    *,
    main: str = "pgqueue_tests",
    results: bool = True,
    conf: Mapping[str, Any] | None = None,
    **transport_options: Any,
) -> Celery:
    """A Celery app (not the current one) whose broker is ``schema`` of ``dsn``."""
    app = Celery(main, set_as_current=False)
    celery_pgqueue.configure(
        app, dsn, results=results, schema=schema, **{**TRANSPORT_OPTIONS, **transport_options}
    )
    app.conf.update({**CONF, **(conf or {})})
    return app


def lazy_app(namespace: dict[str, Any], build: Callable[[], Celery]) -> Callable[[str], Any]:
    """A module's ``__getattr__`` that builds its ``app`` on first use (``celery -A
    module`` looks it up), so that tests import the module's helpers without a worker's
    environment: ``__getattr__ = lazy_app(globals(), app_from_environment)``."""

    def __getattr__(name: str) -> Any:
        if name == "app":
            namespace["app"] = built = build()
            return built
        raise AttributeError(name)

    return __getattr__
