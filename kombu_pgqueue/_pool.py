"""Connection lifecycle: one place that opens, shares and forgets connections.

Every Kombu connection in a process that points at the same database shares one
:class:`psycopg_pool.ConnectionPool` (Celery keeps a pool of Kombu connections per
process; a PostgreSQL pool per Kombu connection would multiply server backends).
After ``fork()`` the child forgets the parent's pools without closing them, since
closing would end the parent's sessions on the shared sockets; psycopg's own
pid check keeps the inherited objects from touching them.

Behind a transaction pooler (PgBouncer, Supavisor, RDS Proxy in transaction mode) a
client's statements go to whichever server session is free, so nothing may rely on a
session: no statement is prepared on the server (PgBouncer before 1.21 would hand a
statement prepared by one client to another: ``prepared statement "_pg3_0" already
exists``), no session setting is made, and LISTEN, which a pooler cannot carry, goes to
transport option ``listen_url`` (the server itself) or is replaced by polling. Whether
the broker URL leads to one is found out with the first connection (:func:`pooled`):
two clients that are served by the same server session at once can only be a pooler's.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from . import _errors, _sql, migrations
from ._options import Options

logger = logging.getLogger(__name__)

#: seconds a LISTEN session waits for its own test NOTIFY (see :func:`listening`)
LISTEN_PROBE_SECONDS = 2.0

_lock = threading.Lock()
#: conninfo -> whether it leads to a transaction pooler (see :func:`pooled`)
_pooled: dict[str, bool] = {}
_pools: dict[tuple[str, int, int | None, float, float, float], ConnectionPool] = {}
_migrated: set[tuple[str, str]] = set()


def _forget_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def connect(conninfo: str, options: Options) -> psycopg.Connection:
    """Open a dedicated autocommit connection (errors are psycopg's, unwrapped), waiting
    for a server that does not answer at most ``publish_timeout`` (a reconnect is part
    of a publish attempt; libpq counts whole seconds, 2 at least). Behind a transaction
    pooler, nothing is prepared on it."""
    kwargs: dict[str, Any] = {}
    bound = options.publish_timeout
    if bound:
        limit = max(2, math.ceil(bound))
        given = conninfo_to_dict(conninfo).get("connect_timeout")
        if given is None or not 0 < int(float(str(given))) <= limit:
            kwargs["connect_timeout"] = limit
    return psycopg.connect(
        conninfo, autocommit=True, prepare_threshold=prepare_threshold(conninfo, options), **kwargs
    )


def prepare_threshold(conninfo: str, options: Options) -> int | None:
    """psycopg's ``prepare_threshold`` for ``conninfo``: None (never) behind a pooler."""
    return None if _pooled.get(conninfo) else options.prepare_threshold


def pooled(conninfo: str) -> bool:
    """Whether ``conninfo`` leads to a transaction pooler, as found when this process
    first opened its pool (False before that)."""
    return _pooled.get(conninfo, False)


def listen_conninfo(conninfo: str, options: Options) -> str | None:
    """Where the LISTEN session connects: ``listen_url`` if given (with this process's
    application_name), the broker's own server otherwise, None behind a pooler."""
    if options.listen_url:
        params = conninfo_to_dict(options.listen_url)
        name = conninfo_to_dict(conninfo).get("application_name")
        if name is not None:
            params.setdefault("application_name", name)
        return make_conninfo("", **params)
    return None if pooled(conninfo) else conninfo


def listening(conninfo: str, options: Options, probe: str) -> psycopg.Connection | None:
    """A dedicated connection that LISTENs on the schema's notification channel; None
    when its test notification, sent from another session (``probe``, a conninfo),
    does not come back within LISTEN_PROBE_SECONDS: a pooler in between takes the
    LISTEN and drops what is sent to it, and waiting on it would wait for ever."""
    target = listen_conninfo(conninfo, options)
    if target is None:
        return None
    conn = connect(target, options)
    try:
        with _errors.writable():  # a standby refuses LISTEN
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(options.channel)))
        if not _notify_arrives(conn, probe, options):
            conn.close()
            return None
    except BaseException:
        conn.close()
        raise
    return conn


def _notify_arrives(conn: psycopg.Connection, probe: str, options: Options) -> bool:
    """Whether a NOTIFY sent from another session reaches ``conn``."""
    channel = f"pgqueue_probe_{secrets.token_hex(8)}"
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    try:
        with connect(probe, options) as sender:
            sender.execute("SELECT pg_notify(%s, '')", (channel,))
        deadline = time.monotonic() + LISTEN_PROBE_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            for notify in conn.notifies(timeout=left):
                if notify.channel == channel:
                    return True
        return False
    finally:
        if not conn.closed:
            conn.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(channel)))


#: Session settings of the broker's pooled connections, which run only the broker's
#: statements. No sequential scans: the hot statements reach the message table by key,
#: but a plan made while the table was small (a seq scan is then the cheapest way to
#: find a few ids) stays cached while the table grows, until autovacuum invalidates
#: it, and each claim and ack would read the whole table meanwhile. Where no index
#: serves a statement (queue_stats, a temporary staging table), it still scans.
#: No JIT: the broker's statements are short, and the cost that enable_seqscan = off
#: puts on a scan with no alternative crosses jit_above_cost, so a 100-row count took
#: 100 ms of which JIT compiling was 99.
#: Generic plans: each statement is planned once per session, not at every execution.
#: The statements are prepared (prepare_threshold) and written so that their values
#: never change the plan (index conditions; the generations pruned by %(floor)s as the
#: executor starts), but the planner, costing a generic plan over every generation of
#: the partitioned storage, preferred to plan each execution anew: a batch of 8 acks
#: cost the server 26-34 us of CPU a message, 9-10 planned once; a claim of 8,
#: 66-81 us against 55-73 (benchmarks/probes/message_cost.py --batch 8).
SESSION_SETTINGS = (
    "SET enable_seqscan = off; SET jit = off; SET plan_cache_mode = force_generic_plan"
)


def statement_timeout(options: Options) -> sql.Composed:
    """The SET that gives a pooled session the ``statement_timeout`` option (0: none)."""
    return sql.SQL("SET statement_timeout = {}").format(
        sql.Literal(int(options.statement_timeout * 1000))
    )


def _configure(options: Options, pooler: bool) -> Callable[[psycopg.Connection], None]:
    settings = sql.SQL("; ").join([sql.SQL(SESSION_SETTINGS), statement_timeout(options)])

    def configure(conn: psycopg.Connection) -> None:
        conn.autocommit = True
        if not pooler:  # behind a pooler, they would stay with a server session
            conn.execute(settings)

    return configure


def get_pool(conninfo: str, options: Options, *, probe: bool = False) -> ConnectionPool:
    """Return this process's pool for ``conninfo``, opening it (and the schema) first.

    A new pool (the first of the process, or after :func:`discard`) starts with a
    plain connection, so a wrong password, a missing database or a server that is
    down raises at once with libpq's own message (naming the host) rather than after
    a pool timeout; that connection installs or checks the schema.

    ``probe`` (a reconnect): open that plain connection even for a cached pool, whose
    connections may be to a server that went away, and check that the server takes
    writes (:class:`~.exceptions.ServerUnavailable` if not). A failed probe discards
    the cached pool, so a failover list or a multi-host URL can lead elsewhere.
    """
    # everything the pool gives its sessions: a connection with another statement_timeout
    # must not borrow sessions set up with this one's
    key = (
        conninfo,
        options.pool_max_size,
        options.prepare_threshold,
        options.statement_timeout,
        options.pool_timeout,
        options.pool_max_idle,
    )
    with _lock:
        pool = _pools.get(key)
        if pool is not None and pool.closed:
            pool = None
        fresh = pool is None or (conninfo, options.schema) not in _migrated
        if fresh or probe:
            try:
                with connect(conninfo, options) as conn, _errors.writable():
                    if probe:
                        _check_writable(conn, options)
                    if fresh:
                        if conninfo not in _pooled:
                            _pooled[conninfo] = _find_pooler(conn, conninfo, options)
                        migrations.ensure(conn, options.schema, auto_migrate=options.auto_migrate)
                        _repair_rotation(conn, options)
            except Exception:
                if pool is not None:
                    del _pools[key]
                    _close_later(pool)
                raise
            _migrated.add((conninfo, options.schema))
        if pool is None:
            # no session is kept for its own sake: an idle publisher (a web process
            # between requests) holds none after pool_max_idle, a worker only the one
            # its heartbeats and timers keep busy (docs/operations.md, "Connections")
            pool = ConnectionPool(
                conninfo,
                min_size=0,
                max_size=options.pool_max_size,
                max_idle=options.pool_max_idle,
                timeout=options.pool_timeout,
                kwargs={
                    "autocommit": True,
                    "prepare_threshold": prepare_threshold(conninfo, options),
                },
                configure=_configure(options, pooled(conninfo)),
                open=False,
                name=f"pgqueue-{os.getpid()}",
            )
            pool.open(wait=True, timeout=options.pool_timeout)
            _pools[key] = pool
        return pool


def _find_pooler(conn: psycopg.Connection, conninfo: str, options: Options) -> bool:
    """Whether ``conninfo`` leads to a transaction pooler (transport option ``pooler``,
    or, "auto", found out): ``conn`` is idle between statements, so a pooler lends its
    server session to the next client, and a second client served by the same session
    as ``conn`` can only be a pooler's. Said once, in one line."""
    if options.pooler != "auto":
        found = options.pooler == "transaction"
    else:
        # on a server each client has a session of its own for its life; a pooler lends
        # the session conn left to the next client (``other``), or, when another client
        # took it meanwhile, gives conn another one
        pid = "SELECT pg_backend_pid()"
        first = conn.execute(pid).fetchone()
        with connect(conninfo, options) as other:
            lent = other.execute(pid).fetchone()
            again = conn.execute(pid).fetchone()
            found = (
                lent in (first, again) or again != first or other.execute(pid).fetchone() != lent
            )
    if found:
        _say_pooler(conn.pgconn, options)
    return found


def found_pooler(conninfo: str, pool: ConnectionPool) -> None:
    """A statement was refused for a prepared statement that another client of the same
    server session made or that its session never had: ``conninfo`` leads to a
    transaction pooler after all (:func:`_find_pooler` can miss one under load). Said
    once; the pool, whose sessions prepare, is replaced by one whose sessions do not."""
    with _lock:
        known = _pooled.get(conninfo)
        _pooled[conninfo] = True
    if not known:
        logger.warning(
            "pgqueue: a prepared statement was refused (a transaction pooler such as "
            "PgBouncer shares server sessions between clients): from now on no statement "
            "is prepared and no session setting is made"
        )
    discard(pool)


def _say_pooler(pgconn: Any, options: Options) -> None:
    """The one line that says a pooler was found, and what follows for wakeups."""
    logger.warning(
        "pgqueue: %s shares server sessions between clients (a transaction pooler such "
        "as PgBouncer): no statement is prepared and no session setting is made; %s",
        _errors.where(pgconn),
        "the LISTEN session connects to listen_url"
        if options.listen_url
        else "consumers poll every "
        f"{min(options.polling_interval, POLL_WITHOUT_LISTEN):g} s (set transport option "
        "listen_url to the server itself for wakeups by NOTIFY)",
    )


#: seconds between two safety polls of a consumer that wanted LISTEN and has none
POLL_WITHOUT_LISTEN = 1.0


def _repair_rotation(conn: psycopg.Connection, options: Options) -> None:
    """After a restore, the generation sequence may be ahead of the generations the
    dump held (statement rotate_repair): put it back before the first publish. A role
    that may not run the rotation leaves it to one that may."""
    try:
        conn.execute(_sql.queries(options.schema)["rotate_repair"])
    except psycopg.errors.InsufficientPrivilege:
        pass


def _check_writable(conn: psycopg.Connection, options: Options) -> None:
    """Raise unless the server of ``conn`` takes writes; one that does not answer within
    ``publish_timeout`` is unavailable too (the connection was closed)."""
    bound = options.publish_timeout
    with _errors.answering(conn, bound, "publish_timeout") if bound else nullcontext():
        row = conn.execute(_sql.queries(options.schema)["writable"]).fetchone()
    if row is None or not row[0]:
        raise _errors.read_only(conn.pgconn)


def discard(pool: ConnectionPool) -> None:
    """Forget ``pool`` and close it (its server went away, or turned read-only): the
    next :func:`get_pool` connects afresh, where a failover list or a multi-host URL
    may lead to another host."""
    with _lock:
        for key, cached in list(_pools.items()):
            if cached is pool:
                del _pools[key]
    _close_later(pool)


def _close_later(pool: ConnectionPool) -> None:
    # in the background: closing waits for the pool's workers, which may be connecting
    threading.Thread(target=pool.close, kwargs={"timeout": 5}, daemon=True).start()


def forget_schema(conninfo: str, schema: str) -> None:
    """Make the next :func:`get_pool` check ``schema`` again (after it was dropped)."""
    with _lock:
        _migrated.discard((conninfo, schema))


@atexit.register
def _close_all() -> None:
    for pool in list(_pools.values()):
        try:
            pool.close(timeout=1)
        except Exception:  # noqa: S110 - interpreter exit, nothing left to tell
            pass
    _pools.clear()
