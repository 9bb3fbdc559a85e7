"""Throwaway PostgreSQL clusters for fault tests and the chaos suite: a primary, its
streaming standbys, and the faults an operator meets (a crash, a promotion, a hung
server, a read-only switch).

.. code-block:: python

    with Cluster.primary() as primary, primary.standby(synchronous=True) as standby:
        ...
        primary.stop("immediate")
        standby.promote()

Each cluster is an ``initdb`` of its own in a temporary directory, listening on
``127.0.0.1`` only (no Unix socket, so clusters never collide), with trust
authentication for everything including replication. The server binaries are
PostgreSQL's ``pg_config --bindir`` (or ``PGQUEUE_PG_BINDIR``); as root they run as
the ``postgres`` user, since ``initdb`` and ``pg_ctl`` refuse root.

Importable from every test directory (``tests/`` is on ``sys.path``) and from the
chaos suite, which puts ``tests/`` on its path. Waits go through
:func:`waiting.wait_for`, bounded by a deadline.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Literal

import psycopg
from waiting import wait_for

#: seconds a server may take to start, stop, promote or catch up
STARTUP_SECONDS = 60.0

#: the settings every cluster starts with; small, because tests start many
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "unix_socket_directories": "''",
    "wal_level": "replica",
    "max_wal_senders": "10",
    "wal_keep_size": "'256MB'",
    "hot_standby": "on",
    "max_connections": "100",
    "shared_buffers": "'32MB'",
    "logging_collector": "off",
    "log_line_prefix": "'%m [%p] '",
}

StopMode = Literal["smart", "fast", "immediate"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bindir() -> Path:
    """Where ``initdb``, ``pg_ctl`` and ``pg_basebackup`` are."""
    given = os.environ.get("PGQUEUE_PG_BINDIR")
    if given:
        return Path(given)
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
        found = Path(out.stdout.strip())
        if (found / "initdb").exists():
            return found
    except (OSError, subprocess.CalledProcessError):
        pass
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
    )
    if not versions:
        raise RuntimeError("no PostgreSQL server binaries: install them or set PGQUEUE_PG_BINDIR")
    return versions[-1].parent


def _as_server_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _own(path: Path) -> None:
    """Hand ``path`` to the user the server runs as."""
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(path, user.pw_uid, user.pw_gid)


class Cluster:
    """One PostgreSQL server in a directory of its own; :meth:`destroy` removes both."""

    def __init__(self, root: Path, port: int, name: str) -> None:
        self.root = root
        self.port = port
        self.name = name
        self.datadir = root / "data"
        self.logfile = root / "server.log"
        self.paused = False
        self.standbys: list[Cluster] = []

    # -- making clusters -----------------------------------------------------------------

    @classmethod
    def primary(
        cls, tmpdir: Path | None = None, port: int | None = None, name: str = "primary"
    ) -> Cluster:
        """``initdb`` and start a primary in a new directory under ``tmpdir``
        (the system's temporary directory by default; the server user must reach it)."""
        cluster = cls(_make_root(tmpdir, name), port or free_port(), name)
        try:
            cluster._run(
                "initdb",
                "-D",
                str(cluster.datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "--encoding=UTF8",
                "--locale=C",
            )
            cluster._configure({**SETTINGS, "port": str(cluster.port)})
            cluster.start()
        except BaseException:
            cluster.destroy()
            raise
        return cluster

    def standby(
        self, port: int | None = None, *, synchronous: bool = False, name: str | None = None
    ) -> Cluster:
        """A streaming standby of this primary (``pg_basebackup -R``), started and caught up.

        ``synchronous=True`` makes this primary's commits wait until the standby has
        flushed them (``synchronous_standby_names``), so a commit that returned survives
        a promotion of the standby.
        """
        name = name or f"{self.name}_standby{len(self.standbys) + 1}"
        standby = Cluster(_make_root(self.root.parent, name), port or free_port(), name)
        try:
            standby._run(
                "pg_basebackup",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-D",
                str(standby.datadir),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            )
            # a standby copied from a synchronous primary must not wait for standbys itself
            # once promoted
            auto = standby.datadir / "postgresql.auto.conf"
            lines = auto.read_text().splitlines(keepends=True)
            auto.write_text("".join(x for x in lines if "synchronous_standby_names" not in x))
            standby._configure({"port": str(standby.port), "cluster_name": f"'{name}'"})
            standby.start()
            self.standbys.append(standby)
            if synchronous:
                self.alter_system("synchronous_standby_names", name)
            wait_for(
                lambda: self._replication_state(name, "sync" if synchronous else None),
                STARTUP_SECONDS,
                f"standby {name} streaming from {self.name}",
                ignore=(psycopg.OperationalError,),
            )
        except BaseException:
            standby.destroy()
            raise
        return standby

    # -- the server's life ---------------------------------------------------------------

    def start(self) -> None:
        self._pg_ctl("start", "-l", str(self.logfile))
        wait_for(self._answers, STARTUP_SECONDS, f"{self.name} to accept connections")

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; ``"immediate"`` is a crash (no checkpoint, clients cut off)."""
        if self.paused:
            self.resume()
        self._pg_ctl("stop", "-m", mode)

    def running(self) -> bool:
        return self._pg_ctl("status", check=False).returncode == 0

    def promote(self) -> None:
        """Make this standby a primary and wait until it takes writes."""
        self._pg_ctl("promote")
        wait_for(
            lambda: not self.in_recovery(),
            STARTUP_SECONDS,
            f"{self.name} to leave recovery",
            ignore=(psycopg.OperationalError,),
        )

    def stop_streaming(self) -> None:
        """Cut this standby off from its primary (``primary_conninfo = ''``), as a broken
        link would: it keeps what it has received, later commits on the primary never
        reach it, and a synchronous primary's commits wait for it."""
        self.alter_system("primary_conninfo", "")

        def cut_off() -> bool:
            with self.connect() as conn:
                return conn.execute("SELECT 1 FROM pg_stat_wal_receiver").fetchone() is None

        wait_for(cut_off, STARTUP_SECONDS, f"{self.name} to stop streaming")

    def in_recovery(self) -> bool:
        with self.connect() as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: a hung server. Connections stay
        open and statements (and new connections) wait until :meth:`resume`."""
        pids = self._server_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass  # a backend or worker that ended since it was listed
        self.paused = True

    def resume(self) -> None:
        for pid in reversed(self._server_pids()):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.paused = False

    def set_read_only(self, read_only: bool) -> None:
        """Make new transactions read-only (``default_transaction_read_only``), as a
        server being fenced off is; sessions take it at their next statement."""
        self.alter_system("default_transaction_read_only", "on" if read_only else "off")

    def destroy(self) -> None:
        """Stop at once (if running) and delete the directory; this cluster's standbys too."""
        for standby in self.standbys:
            standby.destroy()
        if self.paused:
            self.resume()
        if (self.datadir / "postmaster.pid").exists():
            self._pg_ctl("stop", "-m", "immediate", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    # -- clients -------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres", timeout: int = 5) -> psycopg.Connection:
        return psycopg.connect(self.dsn_for(dbname), autocommit=True, connect_timeout=timeout)

    def create_database(self, dbname: str) -> str:
        """Create ``dbname``; return its DSN."""
        with self.connect() as conn:
            conn.execute(
                psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(dbname))
            )
        return self.dsn_for(dbname)

    def alter_system(self, setting: str, value: str) -> None:
        """``ALTER SYSTEM SET setting = 'value'`` and reload; wait until new sessions see it."""
        with self.connect() as conn:
            conn.execute(
                psycopg.sql.SQL("ALTER SYSTEM SET {} = {}").format(
                    psycopg.sql.Identifier(setting), psycopg.sql.Literal(value)
                )
            )
            conn.execute("SELECT pg_reload_conf()")

        def seen() -> bool:
            with self.connect() as conn:
                row = conn.execute("SELECT current_setting(%s)", (setting,)).fetchone()
            return row is not None and str(row[0]) == value

        wait_for(seen, STARTUP_SECONDS, f"{setting} = {value} on {self.name}")

    def log(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except OSError:
            return ""

    # -- inside --------------------------------------------------------------------------

    def _answers(self) -> bool:
        return (
            subprocess.run(
                [str(bindir() / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
                check=False,
            ).returncode
            == 0
        )

    def _replication_state(self, name: str, sync_state: str | None) -> bool:
        with self.connect() as conn:
            row = conn.execute(
                "SELECT sync_state FROM pg_stat_replication "
                "WHERE application_name = %s AND state = 'streaming'",
                (name,),
            ).fetchone()
        return row is not None and (sync_state is None or row[0] == sync_state)

    def _server_pids(self) -> list[int]:
        """The postmaster, then its children."""
        pidfile = self.datadir / "postmaster.pid"
        postmaster = int(pidfile.read_text().split()[0])
        children = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                children.append(int(entry.name))
        return [postmaster, *children]

    def _configure(self, settings: dict[str, str]) -> None:
        with open(self.datadir / "postgresql.conf", "a") as conf:
            conf.write("\n# tests/clusters.py\n")
            for key, value in settings.items():
                conf.write(f"{key} = {value}\n")

    def _pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-w",
            "-t",
            str(int(STARTUP_SECONDS)),
            *args,
            check=check,
        )

    def _run(
        self, program: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        command = [*_as_server_user(), str(bindir() / program), *args]
        out = subprocess.run(command, capture_output=True, text=True, check=False, cwd=self.root)
        if check and out.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args)} failed ({out.returncode}) for {self.name}:\n"
                f"{out.stdout}{out.stderr}\n--- {self.logfile}:\n{self.log()[-3000:]}"
            )
        return out


def _make_root(tmpdir: Path | None, name: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"pgqueue-{name}-", dir=tmpdir))
    _own(root)
    return root
