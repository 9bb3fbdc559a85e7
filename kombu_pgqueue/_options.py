"""Pure functions: transport options and connection parameters.

Nothing here touches a database, so it is unit-tested without one.

The transport options, with type, default and meaning, are documented in one place,
docs/configuration.md ("Transport options"), where the README and the modules send
users; a field added to :class:`Options` is described there in the same change.
"""

from __future__ import annotations

import difflib
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from psycopg import conninfo as pg_conninfo
from psycopg import pq

from .exceptions import ConfigurationError

logger = logging.getLogger(__name__)

DEFAULT_SCHEMA = "pgqueue"
#: ``pool_max_idle`` when transport option ``relay`` is on and it is not given: a relayed
#: fleet is one that must hold few sessions, and an idle consumer's pool closes its own
RELAY_POOL_MAX_IDLE = 2.0
_MAX_IDENTIFIER = 63


def _libpq_keywords() -> frozenset[str]:
    return frozenset(opt.keyword.decode() for opt in pq.Conninfo.get_defaults() if opt.keyword)


LIBPQ_KEYWORDS = _libpq_keywords()


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The transport options that shape the broker's behaviour."""

    schema: str = DEFAULT_SCHEMA
    visibility_timeout: float = 60.0
    lease_renewal_interval: float | None = None
    max_attempts: int = 5
    polling_interval: float = 5.0
    sweep_interval: float = 30.0
    rotate_interval: float = 5.0
    generation_max_age: float = 600.0
    generation_dead_rows: int = 100_000
    generation_max_bytes: int = 64 << 20
    slow_claim_seconds: float = 0.005
    resume_seconds: float = 1.0
    idle_inline_seconds: float = 0.02
    listen: bool = True
    #: one LISTEN session per host, shared by its consumers (``_relay``)
    relay: bool = False
    handoff: bool = True
    batch_acks: bool = True
    async_claims: bool = True
    dedup_task_ids: bool = True
    relax_consumer_commits: bool = True
    auto_migrate: bool = True
    pool_max_size: int = 2
    pool_timeout: float = 30.0
    pool_max_idle: float = 30.0
    prepare_threshold: int | None = 5
    confirm_publish: bool = True
    callback_errors: str = "dead_letter"
    unroutable: str = "warn"
    statement_timeout: float = 30.0
    publish_timeout: float = 5.0
    #: where the LISTEN session connects when the broker URL leads to a transaction
    #: pooler (a libpq URL or key=value string of the server itself); None: the broker URL
    listen_url: str | None = None
    #: "auto" (find out at the first connection), "transaction" or "none"
    pooler: str = "auto"
    libpq: Mapping[str, str] = field(default_factory=dict)

    @property
    def renewal_interval(self) -> float:
        return self.lease_renewal_interval or self.visibility_timeout / 3

    @property
    def claim_attempt_limit(self) -> int:
        """``max_attempts`` as the claim statement takes it (0 = no limit)."""
        return self.max_attempts if self.max_attempts > 0 else 2**31 - 1

    @property
    def channel(self) -> str:
        return notify_channel(self.schema)


def _number(name: str, value: Any, *, minimum: float, integer: bool = False) -> Any:
    try:
        number = int(value) if integer else float(value)
        if number != number:  # NaN compares false with everything, limits included
            raise ValueError(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"transport option {name!r} must be a number, got {value!r}"
        ) from None
    if number < minimum:
        raise ConfigurationError(
            f"transport option {name!r} must be at least {minimum}, got {value!r}"
        )
    return number


_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ConfigurationError(f"transport option {name!r} must be true or false, got {value!r}")


#: the longest queue or exchange name, routing or binding key, in UTF-8 bytes: names are
#: keys of btree indexes, whose entries cannot exceed about a third of a page
MAX_NAME_BYTES = 1024


def check_name(kind: str, name: Any) -> str:
    """Return ``name`` if it can be stored as a queue/exchange name, else raise."""
    if not isinstance(name, str):
        raise ConfigurationError(f"{kind} name must be a string, got {name!r}")
    if "\x00" in name:
        raise ConfigurationError(f"{kind} name {name!r} contains a NUL character")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ConfigurationError(
            f"{kind} name {name[:40]!r}... is {size} bytes long; pgqueue takes names of at "
            f"most {MAX_NAME_BYTES} bytes (UTF-8): use a shorter name"
        )
    return name


def check_schema(schema: Any) -> str:
    name = check_name("schema", schema)
    if not name or len(name.encode()) > _MAX_IDENTIFIER:
        raise ConfigurationError(f"schema name {name!r} must be 1 to {_MAX_IDENTIFIER} bytes long")
    if "%" in name:
        # psycopg would read it as a query parameter in every statement on the schema
        raise ConfigurationError(f"schema name {name!r} may not contain '%': choose another")
    if name.startswith("pg_"):  # as PostgreSQL checks: case-sensitive
        raise ConfigurationError(
            f"schema name {name!r}: PostgreSQL reserves names that begin with 'pg_' for "
            "its own schemas; choose another"
        )
    return name


def notify_channel(schema: str) -> str:
    """Return the LISTEN/NOTIFY channel of ``schema`` (an identifier of at most 63 bytes)."""
    name = f"{schema}.notify"
    if len(name.encode()) <= _MAX_IDENTIFIER:
        return name
    return f"pgqueue.{zlib.crc32(schema.encode()):08x}.notify"


#: transport options that are not pgqueue's but reach it without a mistake: Kombu's
#: retry policy, and other brokers' options a migrated app still sets
FOREIGN_OPTIONS = frozenset(
    {
        "max_retries", "interval_start", "interval_step", "interval_max", "errback",
        "fanout_prefix", "fanout_patterns", "global_keyprefix", "sep",
        "priority_steps", "queue_order_strategy", "socket_timeout", "socket_connect_timeout",
        "health_check_interval", "master_name", "region", "predefined_queues",
        "client_properties", "heartbeat", "ack_emulation", "unacked_mutex_expire",
        "claim_thread",
    }
)  # fmt: skip

_warned: set[str] = set()


def _warn_unknown(keys: Iterable[str]) -> None:
    """Warn once per process about an option pgqueue does not know, naming the closest."""
    known = [f.name for f in fields(Options)] + ["libpq", "async_claims", "synchronous_commit"]
    for key in keys:
        if key in known or key in _warned or key in FOREIGN_OPTIONS or key in LIBPQ_KEYWORDS:
            continue
        _warned.add(key)
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        logger.warning(
            "pgqueue: ignoring transport option %r: not one of pgqueue's%s",
            key,
            f"; did you mean {close[0]!r}?" if close else " (see kombu_pgqueue._options)",
        )


def parse_options(transport_options: Mapping[str, Any]) -> Options:
    """Build :class:`Options` from Kombu's ``transport_options``.

    Unknown keys are ignored, with a warning once per process (naming the closest valid
    option) unless they are Kombu's retry-policy keys or other brokers' options (see
    :data:`FOREIGN_OPTIONS`). Keys that are libpq keywords (``sslmode``,
    ``application_name``, ...) are collected for the connection.
    """
    topts = dict(transport_options)
    _warn_unknown(topts)
    libpq = {k: str(v) for k, v in topts.items() if k in LIBPQ_KEYWORDS and v is not None}
    libpq.update({k: str(v) for k, v in (topts.get("libpq") or {}).items()})
    commit = topts.get("synchronous_commit")
    if commit is not None:
        if str(commit) not in {"on", "off", "local", "remote_write", "remote_apply"}:
            raise ConfigurationError(
                "transport option 'synchronous_commit' must be one of on, off, local, "
                f"remote_write, remote_apply; got {commit!r}"
            )
        libpq["options"] = (libpq.get("options", "") + f" -c synchronous_commit={commit}").strip()
    unknown = set(libpq) - LIBPQ_KEYWORDS
    if unknown:
        raise ConfigurationError(f"unknown libpq connection parameters: {sorted(unknown)}")
    kwargs: dict[str, Any] = {"libpq": libpq}
    if "schema" in topts:
        kwargs["schema"] = check_schema(topts["schema"])
    for name, minimum in (
        ("visibility_timeout", 1.0),
        ("polling_interval", 0.01),
        ("sweep_interval", 0.1),
        ("rotate_interval", 0.1),
        ("generation_max_age", 0.0),
        ("slow_claim_seconds", 0.0),
        ("resume_seconds", 0.0),
        ("idle_inline_seconds", 0.0),
        ("pool_timeout", 0.1),
        ("pool_max_idle", 0.5),
        ("statement_timeout", 0.0),
        ("publish_timeout", 0.0),
    ):
        if topts.get(name) is not None:
            kwargs[name] = _number(name, topts[name], minimum=minimum)
    if topts.get("lease_renewal_interval") is not None:
        kwargs["lease_renewal_interval"] = _number(
            "lease_renewal_interval", topts["lease_renewal_interval"], minimum=0.05
        )
    for name, minimum in (
        ("max_attempts", 0),
        ("pool_max_size", 2),
        ("generation_dead_rows", 1),
        ("generation_max_bytes", 1),
    ):
        if topts.get(name) is not None:
            kwargs[name] = _number(name, topts[name], minimum=minimum, integer=True)
    if "prepare_threshold" in topts:
        value = topts["prepare_threshold"]
        kwargs["prepare_threshold"] = (
            None if value is None else _number("prepare_threshold", value, minimum=0, integer=True)
        )
    for name, choices in (
        ("unroutable", ("warn", "raise")),
        ("callback_errors", ("dead_letter", "raise")),
        ("pooler", ("auto", "transaction", "none")),
    ):
        if topts.get(name) is not None:
            if topts[name] not in choices:
                raise ConfigurationError(
                    f"transport option {name!r} must be one of "
                    f"{', '.join(repr(c) for c in choices)}, got {topts[name]!r}"
                )
            kwargs[name] = topts[name]
    if topts.get("listen_url"):
        kwargs["listen_url"] = check_listen_url(topts["listen_url"])
    if "claim_thread" in topts and "async_claims" not in topts:
        topts["async_claims"] = topts["claim_thread"]  # its name before 2026-11-24
    for name in (f.name for f in fields(Options) if f.type == "bool"):  # the flags
        if name in topts:
            kwargs[name] = _flag(name, topts[name])
    if kwargs.get("relay") and topts.get("pool_max_idle") is None:
        kwargs["pool_max_idle"] = RELAY_POOL_MAX_IDLE
    options = Options(**kwargs)
    if not options.confirm_publish and options.unroutable == "raise":
        raise ConfigurationError(
            "transport options 'confirm_publish': False and 'unroutable': 'raise' do not go "
            "together: an unconfirmed publish has returned before the server routes it "
            "(set unroutable='warn', or keep confirm_publish)"
        )
    if options.renewal_interval >= options.visibility_timeout:
        raise ConfigurationError(
            "transport option 'lease_renewal_interval' must be shorter than "
            f"'visibility_timeout' ({options.visibility_timeout}s), "
            f"got {options.renewal_interval}s"
        )
    return options


def check_failover_list(urls: Sequence[str]) -> None:
    """Refuse a failover list (``broker_url = "url1;url2"``) whose URLs give a port, or
    a database, in some and not in others: when Kombu fails over to a URL without one,
    it keeps the one of the URL it left (``Connection.switch``), and would connect to
    the wrong port or database, refused at once, while the right server waits."""
    from kombu.utils.url import maybe_sanitize_url, parse_url

    if len(urls) < 2:
        return
    parsed = [(url, _url_gives(url, parse_url)) for url in urls if "://" in url]
    for key, what in (("port", "a port"), ("virtual_host", "a database")):
        given = [url for url, gives in parsed if key in gives]
        missing = [url for url, gives in parsed if key not in gives]
        if given and missing:
            raise ConfigurationError(
                f"broker URL {maybe_sanitize_url(missing[0])!r} of a failover list gives no "
                f"{what[2:]} where "
                f"{maybe_sanitize_url(given[0])!r} gives one: Kombu would keep the other's "
                f"when it fails over to it; give every URL of the list {what}"
            )


def _url_gives(url: str, parse_url: Any) -> set[str]:
    """Which of port and database (Kombu's virtual_host) a broker URL gives; a libpq URL
    (``pgqueue+postgresql://...``) gives what its own parameters give."""
    scheme, _, rest = url.partition("://")
    if "+" in scheme:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        try:
            params = conninfo_to_dict(scheme.split("+", 1)[1] + "://" + rest)
        except psycopg.ProgrammingError:
            return set()
        names = (("port", "port"), ("virtual_host", "dbname"))
        return {key for key, name in names if params.get(name)}
    fields = parse_url(url)
    return {key for key in ("port", "virtual_host") if fields.get(key)}


def check_listen_url(url: Any) -> str:
    """Transport option ``listen_url``: a libpq URL or key=value string (``pgqueue://``
    taken as ``postgresql://``), returned as a libpq string."""
    text = str(url)
    if text.startswith("pgqueue://"):
        text = "postgresql://" + text[len("pgqueue://") :]
    try:
        params = pg_conninfo.conninfo_to_dict(text)
    except Exception as exc:
        raise ConfigurationError(
            f"transport option 'listen_url' must be a PostgreSQL URL or key=value string "
            f"of the server itself (not of a pooler), got {mask(text)!r}: {exc}"
        ) from None
    return pg_conninfo.make_conninfo("", **params)


def connection_conninfo(connection: Any, libpq: Mapping[str, str]) -> str:
    """The libpq string of a ``kombu.Connection``'s URL fields (the transport's and the
    admin API's alike, so the two share a pool)."""
    return build_conninfo(
        hostname=connection.hostname,
        port=connection.port,
        userid=connection.userid,
        password=connection.password,
        virtual_host=connection.virtual_host,
        connect_timeout=connection.connect_timeout,
        libpq=libpq,
    )


def build_conninfo(
    *,
    hostname: str | None,
    port: int | None,
    userid: str | None,
    password: str | None,
    virtual_host: str | None,
    connect_timeout: float | None = None,
    libpq: Mapping[str, str] | None = None,
) -> str:
    """Turn Kombu's parsed URL fields into a libpq connection string.

    ``hostname`` may itself be a libpq URL (``pgqueue+postgresql://...`` hands the
    part after the ``+`` over unparsed); the other fields then only fill gaps.
    """
    params: dict[str, Any] = {}
    if hostname and "://" in hostname:
        try:
            params.update(pg_conninfo.conninfo_to_dict(hostname))
        except Exception as exc:
            raise ConfigurationError(
                f"cannot parse database URL {mask(hostname)!r}: {exc}"
            ) from None
    elif hostname:
        params["host"] = hostname
    # the URL's own values win; Kombu's parsed fields only fill gaps
    fields: dict[str, Any] = {"port": port, "user": userid, "password": password}
    if virtual_host and virtual_host != "/":
        fields["dbname"] = virtual_host.lstrip("/")
    for key, value in fields.items():
        if value and key not in params:
            params[key] = value
    if connect_timeout and "connect_timeout" not in params:
        # libpq takes whole seconds and treats 1 as 2; round up to stay honest
        params["connect_timeout"] = max(2, int(-(-connect_timeout // 1)))
    params.update(libpq or {})
    params.setdefault("application_name", f"pgqueue[{os.getpid()}]")
    try:
        return pg_conninfo.make_conninfo("", **params)
    except Exception as exc:
        raise ConfigurationError(f"bad connection parameters: {exc}") from None


def mask(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``**``."""
    try:
        params = pg_conninfo.conninfo_to_dict(dsn)
    except Exception:
        return "<unparseable connection string>"
    if "password" in params:
        params["password"] = "**"
    return pg_conninfo.make_conninfo("", **params)


def missing_transport(scheme: str, written: str) -> str | None:
    """What to do about a broker URL of ``scheme`` that Kombu has no transport for, when
    pgqueue can tell (a PostgreSQL URL: ``written`` is what to write instead; or
    ``pgqueue://`` not registered); None otherwise. Kombu's error says it where this
    package is imported (:func:`no_transport`), and so do Celery's worker, the CLI and
    the pytest plugin (``celery_pgqueue``)."""
    kind = scheme.split("+")[0].lower()
    if kind in ("postgresql", "postgres"):
        return (
            f"Kombu has no {scheme}:// transport; write {written} (or call "
            "celery_pgqueue.configure(app, dsn), which makes it)"
        )
    if kind == "pgqueue":
        return (
            "the pgqueue:// transport is not registered in this process: import "
            "celery_pgqueue (or kombu_pgqueue) where the app is made, or set "
            "broker_transport = 'kombu_pgqueue.transport:Transport'"
        )
    return None


def no_transport(scheme: str) -> Callable[[], str]:
    """An entry of Kombu's ``TRANSPORT_ALIASES`` for ``scheme``, a PostgreSQL URL scheme
    Kombu has no transport for. Kombu calls an entry that is callable to resolve the
    name; this one raises Kombu's own ``KeyError: 'No such transport: ...'``, with what
    to write instead. It never resolves: a ``postgresql://`` URL that worked only where
    pgqueue is imported would fail in every process that does not import it."""

    def resolve() -> str:
        written = f"the same URL with pgqueue:// in place of {scheme}://"
        raise KeyError(f"No such transport: {scheme}. {missing_transport(scheme, written)}")

    return resolve
