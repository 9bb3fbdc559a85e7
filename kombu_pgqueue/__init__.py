"""PostgreSQL as a Kombu/Celery broker.

Importing this package registers the ``pgqueue`` transport alias, so
``kombu.Connection("pgqueue://user@host/db")`` and Celery's
``broker_url = "pgqueue://..."`` work. Apps that cannot import it first can set
``broker_transport = "kombu_pgqueue.transport:Transport"`` instead.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from .exceptions import (
    ConfigurationError,
    MessageError,
    PgQueueError,
    PrivilegeError,
    ResourceError,
    SchemaError,
    ServerUnavailable,
)
from .migrations import current_version, migrate
from .transactions import transaction

TRANSPORT_ALIASES.setdefault("pgqueue", "kombu_pgqueue.transport:Transport")

#: the distribution's version: pyproject.toml reads it from here (the one place it is set)
__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "MessageError",
    "PgQueueError",
    "PrivilegeError",
    "ResourceError",
    "SchemaError",
    "ServerUnavailable",
    "Transport",
    "current_version",
    "migrate",
    "transaction",
]


def __getattr__(name: str) -> object:
    # the transport imports kombu's virtual machinery; load it only when asked
    if name == "Transport":
        from .transport import Transport

        return Transport
    raise AttributeError(name)
