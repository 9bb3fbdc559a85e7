"""Django: tasks written by Django's own connection, inside its ``atomic()`` blocks.

The broker's schema lives in the Django database; a task published inside
``transaction.atomic()`` is a row of that transaction. Workers see it at commit
(its NOTIFY is sent then), a rollback leaves nothing, and a rolled-back nested
``atomic()`` (a savepoint) drops only the tasks published inside it.

One block, explicitly:

.. code-block:: python

    from django.db import connection, transaction
    import kombu_pgqueue

    with transaction.atomic(), kombu_pgqueue.transaction(connection):
        order = Order.objects.create(total=42)
        ship_order.delay(order.pk)

Or every ``atomic()`` block of the project, enabled once (``AppConfig.ready``):

.. code-block:: python

    celery_pgqueue.django.enlist_atomic()          # the "default" database

Outside ``atomic()`` a publish behaves as usual: it goes through the broker's own
connections and is visible at once. When the broker is another database, the
first publish inside an enlisted block raises
:class:`~kombu_pgqueue.ConfigurationError`; publish from
``transaction.on_commit(...)`` instead.

:func:`dsn` turns a ``DATABASES`` entry into the DSN for
:func:`celery_pgqueue.configure`, and :func:`database_settings` the other way
round, so that the broker and Django cannot point at different databases by
accident. The statements go through Django's cursor (so they show in
``connection.queries``); Django picks psycopg 3 whenever it is installed, as it is
with pgqueue.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from kombu_pgqueue import transactions
from kombu_pgqueue.exceptions import ConfigurationError

__all__ = ["database_settings", "dsn", "enlist_atomic"]

# the Enlisted of a DatabaseWrapper (one per thread), so the schema is checked once
_ENLISTED = "_pgqueue_enlisted"
_undo: dict[str, Callable[[], None]] = {}
# django.db is imported when used, so that settings.py may call database_settings()
DEFAULT_DB_ALIAS = "default"


def enlist_atomic(using: str = DEFAULT_DB_ALIAS) -> Callable[[], None]:
    """Write publishes made inside ``atomic(using=using)`` blocks through that connection.

    Process-wide and idempotent; returns a function that turns it off again. A
    publish outside any ``atomic()`` block is not affected, nor one made while only
    another database's block is open.
    """
    from django.db import connections

    if using in _undo:
        return _undo[using]
    vendor = connections[using].vendor
    if vendor != "postgresql":
        raise ConfigurationError(
            f"enlist_atomic() needs a PostgreSQL database; Django's {using!r} is {vendor!r}"
        )

    def resolve() -> transactions.Enlisted | None:
        conn = connections[using]
        if not conn.in_atomic_block:
            return None
        enlisted: transactions.Enlisted | None = getattr(conn, _ENLISTED, None)
        if enlisted is None:
            enlisted = transactions.enlist(conn)
            setattr(conn, _ENLISTED, enlisted)
        return enlisted

    remove = transactions.add_resolver(resolve)

    def undo() -> None:
        remove()
        _undo.pop(using, None)

    _undo[using] = undo
    return undo


def dsn(using: str = DEFAULT_DB_ALIAS) -> str:
    """The libpq DSN of Django's ``using`` database, for ``celery_pgqueue.configure``."""
    from django.db import connections

    params = connections[using].get_connection_params()
    # drop what Django adds for its own driver objects (cursor_factory, context, ...)
    plain = {
        key: value
        for key, value in params.items()
        if isinstance(value, str | int) and not isinstance(value, bool)
    }
    return make_conninfo("", **plain)


def database_settings(dsn: str, **extra: Any) -> dict[str, Any]:
    """A ``DATABASES`` entry (psycopg backend) for a libpq URL or key=value DSN.

    Parameters other than database, user, password, host and port go to
    ``OPTIONS`` (``sslmode``, ``options``, ...). ``extra`` is merged in
    (``CONN_MAX_AGE``, ``ATOMIC_REQUESTS``, ...).
    """
    params = {key: str(value) for key, value in conninfo_to_dict(dsn).items()}
    user = params.pop("user", None) or os.environ.get("PGUSER") or getpass.getuser()
    # libpq's default database is the user's name
    name = params.pop("dbname", None) or os.environ.get("PGDATABASE") or user
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": user,
        "PASSWORD": params.pop("password", ""),
        "HOST": params.pop("host", ""),
        "PORT": params.pop("port", ""),
        "OPTIONS": params,
        **extra,
    }
