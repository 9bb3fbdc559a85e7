"""PostgreSQL as a Kombu/Celery broker.

Importing this package registers the ``pgqueue`` transport alias, so
``kombu.Connection("pgqueue://user@host/db")`` and Celery's
``broker_url = "pgqueue://..."`` work. Apps that cannot import it first can set
``broker_transport = "kombu_pgqueue.transport:Transport"`` instead. Kombu has no way to
find a transport that nothing imported (no entry points: only its own alias table). A
``postgresql://`` URL, which Kombu has no transport for either, fails with Kombu's
``KeyError`` as before, saying what to write instead.
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from ._options import no_transport
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
# Kombu has no transport for PostgreSQL's own URL schemes: their KeyError says what to
# write instead (a name Kombu has, or gets one day, stays Kombu's)
for _scheme in ("postgresql", "postgres"):
    # the table's type says names only; Kombu's resolve_transport calls a callable entry
    TRANSPORT_ALIASES.setdefault(_scheme, no_transport(_scheme))  # type: ignore[arg-type]

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
