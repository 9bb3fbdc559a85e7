"""The broker's SQL: ``sql/queries.sql`` parsed into named statements.

Each statement is written once, under a ``-- name: <name> :<kind>`` header, with
``{schema}`` where the schema goes. :func:`queries` composes them for one schema
with :class:`psycopg.sql.Identifier`, so a schema name can never be read as SQL, and
the advisory locks' keys (:data:`LOCKS`) by name. :func:`traits` says what each
statement needs from the code that sends it (:class:`Traits`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

import psycopg
from psycopg import sql

_HEADER = re.compile(r"^-- name: (?P<name>\w+) :(?P<kind>one|many|none)\s*$", re.MULTILINE)
#: a statement whose text starts with this line is its base statement with the rest of
#: its text (comments dropped) in place of the base's ``{position}``
_EXTENDS = re.compile(r"\A-- extends: (?P<base>\w+)\s*$", re.MULTILINE)
_SLOT = "{position}"
#: what a base statement's ``{position}`` holds in the base itself (none: nothing)
_UNFILLED = re.compile(r"^\s*-- unfilled: (?P<fill>.+)$", re.MULTILINE)
_COMMENT = re.compile(r"^\s*--.*$\n?", re.MULTILINE)

#: The first key of each of the broker's advisory locks ('pgq' and a letter, as four
#: bytes; the second key is a hash of what is locked), written ``{lock_...}`` in the
#: statements and migrations, which are composed with these.
LOCKS = {
    # 'pgqB': the leading beat's session holds (hashtext(schema)) while it leads (0017)
    "lock_beat": 0x70677142,
    # 'pgqC': a consumer's LISTEN session holds (consumer) while it lives (migration 0009)
    "lock_consumer": 0x70677143,
    # 'pgqP': a publish that looked for a waiting consumer, (channel:queue) shared until
    # its commit (migration 0007, see the top of sql/queries.sql)
    "lock_publishing": 0x70677150,
    # 'pgqR': the rotation of one schema (schema), one process at a time (migration 0012)
    "lock_rotation": 0x70677152,
    # 'pgqW': a consumer waits for a queue, (channel:queue) (statement watch)
    "lock_waiting": 0x70677157,
}
_LOCK_LITERALS = {name: sql.Literal(key) for name, key in LOCKS.items()}


def _named(text: str, source: str, found: dict[str, str]) -> None:
    headers = list(_HEADER.finditer(text))
    for header, following in zip(headers, headers[1:] + [None]):
        end = following.start() if following else len(text)
        if header["name"] in found:
            raise RuntimeError(f"query {header['name']!r} is named twice ({source})")
        found[header["name"]] = text[header.end() : end].strip()


@cache
def raw_queries() -> dict[str, str]:
    """Return ``{name: statement text}`` with ``{schema}`` still in place.

    Every ``sql/*.sql`` file but ``schema.sql`` (the schema, to read) holds named
    statements (``queries.sql`` the runtime ones, ``monitoring.sql`` the operators'); a
    name may appear once in all of them.
    """
    folder = resources.files(__package__).joinpath("sql")
    found: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql") and entry.name != "schema.sql":
            _named(entry.read_text(encoding="utf-8"), entry.name, found)
    variants = {}
    for name, text in found.items():
        extends = _EXTENDS.match(text)
        if extends:
            fill = _COMMENT.sub("", text).strip()
            variants[name] = found[extends["base"]].replace(_SLOT, fill)
    for name, text in found.items():
        if _SLOT in text and name not in variants:
            unfilled = _UNFILLED.search(text)  # the base itself
            variants[name] = text.replace(_SLOT, unfilled["fill"] if unfilled else "")
    found.update(variants)
    return found


@dataclass(frozen=True, slots=True, kw_only=True)
class Traits:
    """What one statement needs from the code that sends it, besides its parameters'
    values. :meth:`._connected.Connected.rows` applies each trait (and
    :meth:`~._connected.Connected.fill` those that are parameters, for statements sent by
    libpq's own calls); nothing else asks a statement's name what to do.

    The first three are read from the statement's text: a statement that takes the
    parameter has the trait. The last two are declared by name, in :data:`FENCED` and
    :data:`PUBLISH_ATTEMPT`.
    """

    #: takes %(floor)s: the generation floor as this process last read it (see the top
    #: of sql/queries.sql), which is read again first when it is old
    floor: bool = False
    #: takes %(gate)s: a publish. It notifies only a queue somebody waits for, unless in
    #: an application's transaction, through which it then goes (transactions.Enlisted);
    #: a server out of disk or memory fails it at once (_errors.translated)
    publish: bool = False
    #: takes %(synchronous_commit)s: a consumer's statement whose lost commit can only
    #: cause a redelivery; it turns synchronous_commit off for its own commit when the
    #: transport option relax_consumer_commits says so
    relaxed: bool = False
    #: on held messages, by id and lease: sent once more after a serialization failure,
    #: which READ COMMITTED raises only for a row that the rotation moved to another
    #: generation meanwhile (the row is there, with its lease)
    fenced: bool = False
    #: part of one publish attempt: bounded by the publish_timeout option too, which
    #: grows with the message's body (see _connected.PUBLISH_BYTES_PER_SECOND)
    attempt: bool = False


#: statements on held messages, by id and lease (:attr:`Traits.fenced`)
FENCED = frozenset({"ack", "ack_many", "requeue", "release", "bury", "renew"})

#: what one publish attempt runs (:attr:`Traits.attempt`); publish_many, which may carry
#: a big batch, keeps statement_timeout alone
PUBLISH_ATTEMPT = frozenset(
    {
        "publish",
        "publish_replacing",
        "publish_routed",
        "declare_queue",
        "declare_exchange",
        "bind",
        "generation_floor",
    }
)


@cache
def traits() -> dict[str, Traits]:
    """Return ``{name: Traits}`` for every named statement."""
    texts = raw_queries()
    unknown = (FENCED | PUBLISH_ATTEMPT) - texts.keys()
    if unknown:
        raise RuntimeError(f"traits declared for statements that do not exist: {sorted(unknown)}")

    def takes(text: str, parameter: str) -> bool:
        return f"%({parameter})s" in compact(text)  # not in a comment

    return {
        name: Traits(
            floor=takes(text, "floor"),
            publish=takes(text, "gate"),
            relaxed=takes(text, "synchronous_commit"),
            fenced=name in FENCED,
            attempt=name in PUBLISH_ATTEMPT,
        )
        for name, text in texts.items()
    }


@cache
def _advice_texts() -> dict[str, str]:
    found: dict[str, str] = {}
    entry = resources.files(__package__).joinpath("sql", "advice", "grants.sql")
    _named(entry.read_text(encoding="utf-8"), "advice/grants.sql", found)
    return found


def advice(name: str, conn: psycopg.Connection, **identifiers: str) -> str:
    """A statement from ``sql/advice/grants.sql`` for an administrator, as text.

    Never executed by pgqueue: error messages print it, on one line, so without the
    file's comments (each would hide the statements after it). Names are quoted as
    identifiers.
    """
    composed = sql.SQL(_COMMENT.sub("", _advice_texts()[name])).format(
        **{key: sql.Identifier(value) for key, value in identifiers.items()}
    )
    return " ".join(composed.as_string(conn).split())


def compact(text: str) -> str:
    """``text`` without its comment lines and indentation.

    What a statement costs the client grows with its length: psycopg caches the parse of
    a statement's ``%(name)s`` placeholders only for texts up to 4096 bytes
    (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``) and splits a longer one with a
    regular expression at every execution, about 130 us for a publish of 6 kB. No
    statement here has a string literal that spans lines, so nothing else changes.
    """
    lines = (line.strip() for line in _COMMENT.sub("", text).splitlines())
    return "\n".join(line for line in lines if line)


@cache
def queries(schema: str) -> dict[str, sql.Composed]:
    """Return every named statement composed for ``schema``, compacted (:func:`compact`)."""
    ident = sql.Identifier(schema)
    return {
        name: sql.SQL(compact(text)).format(schema=ident, **_LOCK_LITERALS)
        for name, text in raw_queries().items()
    }


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


@cache
def positional(schema: str, name: str) -> tuple[bytes, tuple[str, ...]]:
    """Statement ``name`` for ``schema`` with ``$1``, ``$2``... in place of ``%(key)s``.

    Returns the text and the key of each position; a key used twice gets one position.
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] is None:
            return "%"
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    text = queries(schema)[name].as_string(None)
    return _PLACEHOLDER.sub(number, text).encode("utf-8"), tuple(names)


def migration_files() -> list[tuple[int, str, str]]:
    """Return ``(version, slug, text)`` for every migration, oldest first."""
    folder = resources.files(__package__).joinpath("sql", "migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return sorted(found)


def compose(text: str, schema: str) -> sql.Composed:
    """Compose a migration's text for ``schema``."""
    return sql.SQL(text).format(schema=sql.Identifier(schema), **_LOCK_LITERALS)
