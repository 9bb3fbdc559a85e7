"""A real PgBouncer in front of the test server, for the tests and benchmarks of the
broker behind a transaction pooler: Debian's ``pgbouncer`` (``apt-get install
pgbouncer``; ``PGQUEUE_PGBOUNCER`` names another binary), started on a free port with
a configuration of its own in a temporary directory, stopped when the block ends.

.. code-block:: python

    with PgBouncer.start(dsn, pool_mode="transaction") as bouncer:
        psycopg.connect(bouncer.dsn)

As root it runs as the ``postgres`` user (PgBouncer refuses root), as the throwaway
clusters of ``clusters.py`` do. Every client logs in as the test server's user
(``auth_type = any``), so the DSN needs no password file.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from clusters import free_port
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from waiting import wait_for


def binary() -> str | None:
    """The pgbouncer to run, or None where there is none."""
    return (
        os.environ.get("PGQUEUE_PGBOUNCER")
        or shutil.which("pgbouncer")
        or next(
            (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
        )
    )


@dataclass
class PgBouncer:
    """A running PgBouncer; :attr:`dsn` leads through it to the server's database."""

    dsn: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    @contextmanager
    def start(
        cls,
        dsn: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 20,
        max_clients: int = 1000,
    ) -> Iterator[PgBouncer]:
        found = binary()
        if found is None:
            raise FileNotFoundError(
                "pgbouncer is not installed: apt-get install pgbouncer "
                "(or set PGQUEUE_PGBOUNCER to its path)"
            )
        server = conninfo_to_dict(dsn)
        dbname = str(server.get("dbname") or "postgres")
        target = {
            "host": server.get("host") or "127.0.0.1",
            "port": server.get("port") or 5432,
            "user": server.get("user") or "postgres",
            "dbname": dbname,
        }
        if server.get("password"):
            target["password"] = server["password"]
        port = free_port()
        work = Path(tempfile.mkdtemp(prefix="pgqueue-pgbouncer-"))
        log = work / "pgbouncer.log"
        config = work / "pgbouncer.ini"
        entry = " ".join(f"{key}={value}" for key, value in target.items())
        config.write_text(
            "[databases]\n"
            f"* = {entry}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "admin_users = postgres\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            f"max_client_conn = {max_clients}\n"
            # libpq's startup parameters that PgBouncer would otherwise refuse
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {log}\n"
            f"pidfile = {work / 'pgbouncer.pid'}\n"
        )
        command = [found, str(config)]
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            socket_dir = str(target["host"])
            if socket_dir.startswith("/") and os.path.isdir(socket_dir):
                # the embedded server's socket, in a directory of root's (0700): the
                # pooler, running as postgres, must reach it
                os.chmod(socket_dir, os.stat(socket_dir).st_mode | 0o011)
            os.chown(work, user.pw_uid, user.pw_gid)
            for path in work.iterdir():
                os.chown(path, user.pw_uid, user.pw_gid)
            command = [found, "-u", "postgres", str(config)]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        through = make_conninfo(
            "", **{**{k: str(v) for k, v in server.items()}, "host": "127.0.0.1", "port": str(port)}
        )
        bouncer = cls(through, port, proc, log)
        try:
            wait_for(
                bouncer._answers, 30, "pgbouncer to accept connections", ignore=(psycopg.Error,)
            )
            yield bouncer
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            shutil.rmtree(work, ignore_errors=True)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            text = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"pgbouncer exited: {err}{text[-2000:]}")
        with psycopg.connect(self.dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
