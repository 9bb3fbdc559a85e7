"""Statements sent with libpq's own calls, for the connections that do not wait for
them (the loop's claimer, the unconfirmed publisher): parameters, preparing, errors.

Parameters go by position (``$n``, :meth:`Store.positional <._store.Store.positional>`)
and the statement gives their types: bytes in binary (a bytea's binary form is its
bytes, no hex on the way), everything else in PostgreSQL's text format.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from psycopg import errors, pq

from . import _pool
from ._store import Store

BINARY = pq.Format.BINARY
TEXT = pq.Format.TEXT


def text_param(value: Any) -> bytes | None:
    """A parameter in PostgreSQL's text format (the statement's context gives its type)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if isinstance(value, datetime):
        return value.isoformat().encode()
    return str(value).encode()


def result_error(store: Store, name: str, result: pq.abc.PGresult, encoding: str) -> BaseException:
    """The error of statement ``name``'s failed ``result``, as pgqueue's (see ``_errors``)."""
    error = errors.error_from_result(result, encoding=encoding)
    if isinstance(error, (errors.DuplicatePreparedStatement, errors.InvalidSqlStatementName)):
        # a transaction pooler that the first connection did not recognise: the session
        # that prepared a statement is not the one this client has now (see _pool)
        _pool.found_pooler(store.conninfo, store.pool)
    try:
        with store.translated(name):
            raise error
    except BaseException as exc:  # noqa: BLE001 - handed back, the caller raises or logs it
        return exc


def prepare(
    pgconn: pq.abc.PGconn, store: Store, names: Iterable[str], encoding: str
) -> dict[str, tuple[str, ...]]:
    """Prepare statements ``names`` (named as they are) and wait; return each one's
    parameter keys. Raises the first statement's error that the server refused."""
    prepared: dict[str, tuple[str, ...]] = {}
    for name in names:
        text, keys = store.positional(name)
        result = pgconn.prepare(name.encode(), text)
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise result_error(store, name, result, encoding)
        prepared[name] = keys
    return prepared


def send(
    pgconn: pq.abc.PGconn,
    store: Store,
    prepared: Mapping[str, tuple[str, ...]],
    name: str,
    params: Mapping[str, Any],
    result_format: pq.Format = TEXT,
) -> None:
    """Send statement ``name`` without waiting for it: the prepared one, or (not
    prepared: ``prepare_threshold`` None, as behind PgBouncer in transaction mode) its
    text, parsed and planned each time as psycopg does then."""
    keys = prepared.get(name)
    text = None
    if keys is None:
        text, keys = store.positional(name)
    values: list[bytes | None] = []
    formats: list[pq.Format] | None = None
    for i, key in enumerate(keys):
        value = params[key]
        if isinstance(value, bytes):
            if formats is None:
                formats = [TEXT] * len(keys)
            formats[i] = BINARY
            values.append(value)
        else:
            values.append(text_param(value))
    if text is None:
        pgconn.send_query_prepared(
            name.encode(), values, param_formats=formats, result_format=result_format
        )
    else:
        pgconn.send_query_params(text, values, param_formats=formats, result_format=result_format)
