"""No SQL text built by string formatting in the package's sources.

Scans ``kombu_pgqueue`` and ``celery_pgqueue`` with :mod:`ast`. A statement passed to
``execute()``, ``executemany()`` or ``copy()``, or wrapped in ``sql.SQL()`` / ``text()``,
must not be an f-string, a ``%`` or ``+`` expression on strings, or ``"...".format()``,
either in the call itself or through a local variable assigned that way in the same
function. Identifiers go through ``psycopg.sql.SQL(...).format(sql.Identifier(...))``,
which stays allowed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kombu_pgqueue", "celery_pgqueue")
EXECUTORS = frozenset({"execute", "executemany", "copy"})
WRAPPERS = frozenset({"SQL", "text"})


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def _wrapped_sql(node: ast.AST) -> bool:
    """``sql.SQL(...)``, ``SQL(...)``, ``sql.Identifier(...)`` and the like: composed SQL."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in {"SQL", "Identifier", "Literal", "Composed", "Placeholder"}


def dynamic_string(node: ast.AST) -> str | None:
    """Why ``node`` builds SQL text by string formatting, or None if it does not."""
    if isinstance(node, ast.JoinedStr) and any(
        isinstance(v, ast.FormattedValue) for v in node.values
    ):
        return "f-string"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _is_str(node.left):
        return "% formatting"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        if _wrapped_sql(node.left) or _wrapped_sql(node.right):
            return None  # sql.SQL(...) + sql.SQL(...) composes
        parts = [node.left, node.right]
        if any(_is_str(p) or dynamic_string(p) for p in parts):
            return "+ concatenation"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and not _wrapped_sql(node.func.value)
        and (_is_str(node.func.value) or dynamic_string(node.func.value))
    ):
        return "str.format"
    return None


def _statement_arg(call: ast.Call) -> ast.AST | None:
    if call.args:
        return call.args[0]
    for keyword in call.keywords:
        if keyword.arg in {"query", "statement", "sql", "text"}:
            return keyword.value
    return None


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _assignments(scope: ast.AST) -> dict[str, list[ast.AST]]:
    found: dict[str, list[ast.AST]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            if node.value is not None:
                value = node.value
                if isinstance(node, ast.AugAssign):
                    value = ast.BinOp(left=ast.Constant(""), op=node.op, right=node.value)
                found.setdefault(node.target.id, []).append(value)
    return found


def findings(source: str, filename: str = "<source>") -> Iterator[str]:
    """``file:line: call(...) gets SQL built by <how>`` for every offending call."""
    tree = ast.parse(source, filename)
    scopes: list[ast.AST] = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    seen: set[tuple[int, int]] = set()
    for scope in scopes:
        local = _assignments(scope)
        for call in ast.walk(scope):
            if not isinstance(call, ast.Call) or (call.lineno, call.col_offset) in seen:
                continue
            name = _call_name(call)
            if name not in EXECUTORS and name not in WRAPPERS:
                continue
            arg = _statement_arg(call)
            if arg is None:
                continue
            how = dynamic_string(arg)
            if how is None and isinstance(arg, ast.Name):
                for value in local.get(arg.id, []):
                    how = dynamic_string(value)
                    if how:
                        how = f"{how} (via variable {arg.id!r})"
                        break
            if how:
                seen.add((call.lineno, call.col_offset))
                yield f"{filename}:{call.lineno}: {name}() gets SQL built by {how}"


def test_the_scan_covers_both_packages() -> None:
    files = {p.relative_to(ROOT).parts[0] for p in _sources()}
    assert files == set(PACKAGES)
    assert len(_sources()) >= 10


@pytest.mark.parametrize(
    "snippet",
    [
        'conn.execute(f"SELECT * FROM {schema}.message")',
        'cur.execute("SELECT * FROM %s.message" % schema)',
        'conn.execute("SELECT * FROM " + schema + ".message")',
        'conn.execute("SELECT * FROM {}.message".format(schema))',
        'cur.copy(f"COPY {table} FROM STDIN")',
        'conn.execute(query="DELETE FROM " + table)',
        'def f(conn, schema):\n    q = f"DROP SCHEMA {schema}"\n    conn.execute(q)',
        'def f(conn, t):\n    q = "SELECT 1 FROM "\n    q += t\n    conn.execute(q)',
        'conn.execute(sql.SQL(f"SELECT * FROM {schema}.message"))',
        'conn.execute(sql.SQL("SELECT * FROM " + schema))',
    ],
)
def test_the_scan_finds_sql_built_from_strings(snippet: str) -> None:
    assert list(findings(snippet)), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        'conn.execute(sql.SQL("SELECT * FROM {}.message").format(sql.Identifier(schema)))',
        'conn.execute("SELECT * FROM t WHERE id = %s", (ident,))',
        'conn.execute(sql.SQL("SELECT 1") + sql.SQL(" WHERE true"))',
        "conn.execute(statements[name], params)",
        "cur.execute(query.as_string(None), params)",
        'logger.info("executing %s" % name)',
        "def f(conn, schema):\n"
        '    q = sql.SQL("DROP SCHEMA {}").format(sql.Identifier(schema))\n'
        "    conn.execute(q)",
    ],
)
def test_the_scan_allows_composed_and_parameterised_sql(snippet: str) -> None:
    assert list(findings(snippet)) == [], snippet


def test_no_sql_is_built_from_strings_in_the_package() -> None:
    found = [
        hit
        for path in _sources()
        for hit in findings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert found == [], "\n".join(found)
