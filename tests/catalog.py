"""A schema described from PostgreSQL's catalog, to compare two schemas line by line.

:func:`describe` lists what a schema holds, one line an item (a function's definition a
line each of its lines), in a fixed order, with the schema's name written ``{schema}``:
relations (kind, persistence, storage options, partitioning, ACL), columns (type,
collation, nullability, default, identity, generated), constraints, indexes
(``pg_get_indexdef``), triggers (``pg_get_triggerdef``), functions
(``pg_get_functiondef`` and ACL), sequences (parameters, owner column, state), types,
comments, and the rows of every table without their ``timestamptz`` and ``bytea``
columns (install times, random keys). It reads the catalog, not ``pg_dump``'s text,
which changes between server versions; both sides of a comparison are read from the
same server, so no line depends on its version.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

#: column types whose values differ between two installs of the same schema
VOLATILE_TYPES = ("timestamp with time zone", "bytea")

_RELATIONS = """
SELECT c.relname AS name, c.relkind::text AS kind, c.relpersistence::text AS persistence,
       array_to_string(ARRAY(SELECT o FROM unnest(c.reloptions) AS o ORDER BY o), ', ')
           AS options,
       CASE WHEN c.relkind = 'p' THEN pg_get_partkeydef(c.oid) END AS partition_key,
       (SELECT string_agg(p.relname, ', ' ORDER BY p.relname)
        FROM pg_inherits AS i JOIN pg_class AS p ON p.oid = i.inhparent
        WHERE i.inhrelid = c.oid) AS parent,
       pg_get_expr(c.relpartbound, c.oid) AS bound,
       c.relrowsecurity AS row_security, c.relforcerowsecurity AS forced,
       c.relreplident::text AS replica_identity,
       CASE WHEN c.relkind IN ('v', 'm') THEN pg_get_viewdef(c.oid) END AS view,
       c.relacl::text AS acl
FROM pg_class AS c
WHERE c.relnamespace = %(nsp)s
ORDER BY c.relname
"""

_COLUMNS = """
SELECT c.relname AS table,
       -- the place among the columns there are (a dropped one leaves a gap in attnum)
       row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
       a.attname AS name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null,
       CASE WHEN a.attcollation <> t.typcollation THEN co.collname END AS collation,
       pg_get_expr(d.adbin, d.adrelid) AS default,
       nullif(a.attidentity::text, '') AS identity,
       nullif(a.attgenerated::text, '') AS generated,
       a.attacl::text AS acl
FROM pg_attribute AS a
JOIN pg_class AS c ON c.oid = a.attrelid
JOIN pg_type AS t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
LEFT JOIN pg_collation AS co ON co.oid = a.attcollation
WHERE c.relnamespace = %(nsp)s
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')
  AND a.attnum > 0
  AND NOT a.attisdropped
ORDER BY c.relname, a.attnum
"""

_CONSTRAINTS = """
SELECT c.relname AS table, k.conname AS name, k.contype::text AS kind,
       pg_get_constraintdef(k.oid) AS definition, k.convalidated AS validated
FROM pg_constraint AS k
JOIN pg_class AS c ON c.oid = k.conrelid
WHERE c.relnamespace = %(nsp)s
ORDER BY c.relname, k.conname
"""

_INDEXES = """
SELECT t.relname AS table, i.relname AS name, pg_get_indexdef(x.indexrelid) AS definition,
       (SELECT p.relname FROM pg_inherits AS h JOIN pg_class AS p ON p.oid = h.inhparent
        WHERE h.inhrelid = i.oid) AS parent
FROM pg_index AS x
JOIN pg_class AS i ON i.oid = x.indexrelid
JOIN pg_class AS t ON t.oid = x.indrelid
WHERE t.relnamespace = %(nsp)s
ORDER BY t.relname, i.relname
"""

_TRIGGERS = """
SELECT c.relname AS table, g.tgname AS name, pg_get_triggerdef(g.oid) AS definition,
       g.tgenabled::text AS enabled
FROM pg_trigger AS g
JOIN pg_class AS c ON c.oid = g.tgrelid
WHERE c.relnamespace = %(nsp)s
  AND NOT g.tgisinternal
ORDER BY c.relname, g.tgname
"""

_FUNCTIONS = """
SELECT p.proname AS name, pg_get_function_identity_arguments(p.oid) AS arguments,
       p.prokind::text AS kind,
       CASE WHEN p.prokind IN ('f', 'p', 'w') THEN pg_get_functiondef(p.oid) END AS definition,
       p.proacl::text AS acl
FROM pg_proc AS p
WHERE p.pronamespace = %(nsp)s
ORDER BY p.proname, 2
"""

_SEQUENCES = """
SELECT c.relname AS name, format_type(s.seqtypid, NULL) AS type, s.seqstart AS start,
       s.seqincrement AS increment, s.seqmin AS min, s.seqmax AS max, s.seqcache AS cache,
       s.seqcycle AS cycle,
       (SELECT t.relname || '.' || a.attname || ' (' || d.deptype::text || ')'
        FROM pg_depend AS d
        JOIN pg_class AS t ON t.oid = d.refobjid
        JOIN pg_attribute AS a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
        WHERE d.classid = 'pg_class'::regclass
          AND d.objid = c.oid
          AND d.refclassid = 'pg_class'::regclass
          AND d.deptype IN ('a', 'i')) AS owner
FROM pg_sequence AS s
JOIN pg_class AS c ON c.oid = s.seqrelid
WHERE c.relnamespace = %(nsp)s
ORDER BY c.relname
"""

# types of their own: not a relation's row type, not an array of another type
_TYPES = """
SELECT t.typname AS name, t.typtype::text AS kind,
       CASE WHEN t.typbasetype <> 0 THEN format_type(t.typbasetype, t.typtypmod) END AS base,
       t.typnotnull AS not_null, t.typdefault AS default,
       (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
        FROM pg_enum AS e WHERE e.enumtypid = t.oid) AS labels,
       t.typacl::text AS acl
FROM pg_type AS t
WHERE t.typnamespace = %(nsp)s
  AND t.typrelid = 0
  AND NOT EXISTS (SELECT 1 FROM pg_type AS e WHERE e.typarray = t.oid)
ORDER BY t.typname
"""

# comments on the schema and on what is in it (objects from initdb have lower oids)
_COMMENTS = """
SELECT pg_describe_object(d.classoid, d.objoid, d.objsubid) AS object, d.description AS text
FROM pg_description AS d
WHERE d.objoid >= 16384
ORDER BY 1
"""

# each table, and those of its columns whose values are left out (VOLATILE_TYPES)
_TABLES = """
SELECT c.relname AS table,
       coalesce(array_agg(a.attname ORDER BY a.attnum)
                FILTER (WHERE format_type(a.atttypid, NULL) = ANY(%(volatile)s)), '{}')
           AS volatile
FROM pg_class AS c
JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE c.relnamespace = %(nsp)s
  AND c.relkind = 'r'
GROUP BY c.relname
ORDER BY c.relname
"""


def _text(value: object) -> str:
    """``value`` on one line (a CASE, a view span lines); ``-`` for NULL."""
    return "-" if value is None else " ".join(str(value).split())


def _relation(r: dict[str, Any]) -> str:
    line = f"relation {r['name']}: kind {r['kind']}, persistence {r['persistence']}"
    if r["options"]:
        line += f", with ({r['options']})"
    if r["partition_key"]:
        line += f", partition by {r['partition_key']}"
    if r["parent"]:
        line += f", partition of {r['parent']} {_text(r['bound'])}"
    if r["row_security"] or r["forced"]:
        line += f", row security {r['row_security']} (forced {r['forced']})"
    if r["replica_identity"] != "d":
        line += f", replica identity {r['replica_identity']}"
    if r["view"]:
        line += f", view {_text(r['view'])}"
    return line + f", acl {_text(r['acl'])}"


def _column(r: dict[str, Any]) -> str:
    line = f"column {r['table']}.{r['name']}: #{r['position']} {r['type']}"
    if r["not_null"]:
        line += " not null"
    if r["collation"]:
        line += f" collate {r['collation']}"
    if r["generated"]:
        line += f" generated ({r['generated']}) as {_text(r['default'])}"
    elif r["default"] is not None:
        line += f" default {_text(r['default'])}"
    if r["identity"]:
        line += f" identity ({r['identity']})"
    if r["acl"]:
        line += f" acl {r['acl']}"
    return line


def _function(r: dict[str, Any]) -> list[str]:
    # a line of the definition a line of the diff, each saying whose it is
    body = str(r["definition"] or "").rstrip("\n").splitlines()
    return [
        f"function {r['name']}({r['arguments']}): kind {r['kind']}, acl {_text(r['acl'])}",
        *(f"function {r['name']} | {line}" for line in body),
    ]


def _sequence(conn: psycopg.Connection, schema: str, r: dict[str, Any]) -> str:
    state = conn.execute(
        sql.SQL("SELECT last_value, is_called FROM {}.{}").format(
            sql.Identifier(schema), sql.Identifier(r["name"])
        )
    ).fetchone()
    return (
        f"sequence {r['name']}: {r['type']} start {r['start']} increment {r['increment']}"
        f" min {r['min']} max {r['max']} cache {r['cache']} cycle {r['cycle']},"
        f" owned by {_text(r['owner'])}, last value and is_called {state}"
    )


def _rows(conn: psycopg.Connection, schema: str, r: dict[str, Any]) -> list[str]:
    # ordered as jsonb: numbers as numbers (schema_migration's versions 1, 2, ... 10)
    found = conn.execute(
        sql.SQL(
            "SELECT s.r::text FROM (SELECT to_jsonb(t) - %(volatile)s::text[] AS r"
            " FROM {}.{} AS t) AS s ORDER BY s.r"
        ).format(sql.Identifier(schema), sql.Identifier(r["table"])),
        {"volatile": r["volatile"]},
    )
    return [f"row {r['table']}: {row}" for (row,) in found]


def _mentions(description: str, schema: str) -> bool:
    """Whether ``pg_describe_object``'s text is about ``schema`` or a thing in it."""
    return any(word == schema or word.startswith(f"{schema}.") for word in description.split())


def describe(conn: psycopg.Connection, schema: str) -> list[str]:
    """Every line that says what ``schema`` holds (see the module's docstring)."""
    found = conn.execute(
        "SELECT oid FROM pg_namespace WHERE nspname = %(schema)s", {"schema": schema}
    ).fetchone()
    assert found is not None, f"schema {schema!r} does not exist"
    params = {"nsp": found[0], "volatile": list(VOLATILE_TYPES)}

    def rows(query: str) -> list[dict[str, Any]]:
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query, params).fetchall()

    lines = [_relation(r) for r in rows(_RELATIONS)]
    lines += [_column(r) for r in rows(_COLUMNS)]
    lines += [
        f"constraint {r['table']}.{r['name']}: {r['kind']} {r['definition']}"
        + ("" if r["validated"] else " NOT VALID")
        for r in rows(_CONSTRAINTS)
    ]
    lines += [
        f"index {r['table']}.{r['name']}: {r['definition']}"
        + (f" (attached to {r['parent']})" if r["parent"] else "")
        for r in rows(_INDEXES)
    ]
    lines += [
        f"trigger {r['table']}.{r['name']}: {r['definition']} (enabled {r['enabled']})"
        for r in rows(_TRIGGERS)
    ]
    for r in rows(_FUNCTIONS):
        lines += _function(r)
    lines += [_sequence(conn, schema, r) for r in rows(_SEQUENCES)]
    lines += [
        f"type {r['name']}: {r['kind']} {_text(r['base'])} not null {r['not_null']}"
        f" default {_text(r['default'])} labels {_text(r['labels'])} acl {_text(r['acl'])}"
        for r in rows(_TYPES)
    ]
    lines += [
        f"comment on {r['object']}: {r['text']}"
        for r in rows(_COMMENTS)
        if _mentions(r["object"], schema)
    ]
    for r in rows(_TABLES):
        lines += _rows(conn, schema, r)
    quoted = sql.Identifier(schema).as_string(None)
    return [line.replace(quoted, "{schema}").replace(schema, "{schema}") for line in lines]
