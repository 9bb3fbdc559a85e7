"""Errors raised by pgqueue.

::

    PgQueueError
     ├── ConfigurationError (also ValueError)  a bad URL, option, queue or exchange name
     ├── SchemaError                           the schema is missing or older than this code,
     │                                         and auto_migrate is off
     ├── PrivilegeError                        the role may not do what the broker needs
     └── MessageError (also ValueError)        a message that cannot be stored as given

Connection failures are psycopg's own ``OperationalError`` / ``InterfaceError``,
never wrapped: Kombu and Celery retry and reconnect on those classes
(``Transport.connection_errors``).
"""

from __future__ import annotations


class PgQueueError(Exception):
    """Base class of every pgqueue error."""


class ConfigurationError(PgQueueError, ValueError):
    """A bad URL, transport option, queue name or exchange name."""


class SchemaError(PgQueueError):
    """The broker schema is missing or older than this code needs."""


class PrivilegeError(PgQueueError):
    """The database role lacks a privilege the broker needs."""


class MessageError(PgQueueError, ValueError):
    """A message that cannot be stored as given."""
