"""Errors raised by pgqueue.

::

    PgQueueError
     ├── ConfigurationError (also ValueError)  a bad URL, option, queue or exchange name
     ├── SchemaError                           the schema is missing or older than this code,
     │                                         and auto_migrate is off; or it holds another
     │                                         application's tables
     ├── PrivilegeError                        the role may not do what the broker needs
     ├── MessageError (also ValueError)        a message that cannot be stored as given
     ├── ResourceError                         the server lacks disk, memory or a configured
     │                                         limit for a publish (SQLSTATE class 53): raised
     │                                         at once, since a reconnect cannot fix it
     └── ServerUnavailable (also psycopg's     the server takes no writes now (read-only, a
         OperationalError)                     standby, a failover) or did not answer in time

Connection failures are psycopg's own ``OperationalError`` / ``InterfaceError``,
never wrapped: Kombu and Celery retry and reconnect on those classes
(``Transport.connection_errors``). :class:`ServerUnavailable` is one of them, so a
worker waits for a primary and a publish follows its retry policy.
"""

from __future__ import annotations

import psycopg


class PgQueueError(Exception):
    """Base class of every pgqueue error."""


class ConfigurationError(PgQueueError, ValueError):
    """A bad URL, transport option, queue name or exchange name."""


class SchemaError(PgQueueError):
    """The broker schema is missing or older than this code needs, or it is another
    application's (a table of the same name is in the way)."""


class PrivilegeError(PgQueueError):
    """The database role lacks a privilege the broker needs."""


class MessageError(PgQueueError, ValueError):
    """A message that cannot be stored as given."""


class ResourceError(PgQueueError):
    """The server lacks a resource a publish needs: disk space (a full tablespace or
    ``pg_wal``), memory, or a configured limit (SQLSTATE class 53, but
    ``too_many_connections``). A reconnect cannot fix that, so it is not a connection
    error: Kombu's retry policy does not retry it, and the publish fails at once. The
    SQLSTATE is the ``sqlstate`` attribute; psycopg's error is ``__cause__``."""

    sqlstate: str | None = None


class ServerUnavailable(PgQueueError, psycopg.OperationalError):
    """The database server cannot take the broker's work now: it is read-only (a
    standby, a failover in progress, ``default_transaction_read_only``) or did not
    answer within ``statement_timeout`` (a publish: ``publish_timeout``). A connection
    error: Kombu and Celery reconnect and retry."""
