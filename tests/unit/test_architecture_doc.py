"""docs/architecture.md names every module of the two packages, and only modules that exist.

The convention the document follows (its "Module map" says so too): the section
``## Module map`` holds one fenced block per package, whose first line is the package's
path (``kombu_pgqueue/``, ``celery_pgqueue/spark/``); every ``name.py`` in a block is a
module of that package, and every module of the package is in its block. Anywhere in the
document, a ``name.py`` must be a module of one of the packages, a ``path/name.py`` a
file of the repository, and a ``_name.`` (``_store.Store``) a private module of one of
the packages.

Packages are found, not listed: a new module or subpackage fails these tests until the
map names it, and a module renamed or removed fails them until the map follows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TOPS = ("kombu_pgqueue", "celery_pgqueue")

#: a module's file name, not the tail of a longer name or path (``_messages.py`` is not
#: ``messages.py``; ``spark/_rows.py`` is a path)
MODULE = re.compile(r"(?<![\w./])(\w+\.py)\b")
PATH = re.compile(r"(?<![\w./])((?:\w+/)+\w+\.py)\b")
#: ``_store.Store``, ``_sql.positional``: a private module, then one of its names
PRIVATE = re.compile(r"(?<![\w.])(_[a-z]\w*)\.(?!py\b)[A-Za-z_]")


def packages() -> list[str]:
    """Every package of the two, as ``kombu_pgqueue/``, ``celery_pgqueue/spark/``."""
    found = (init.parent for top in TOPS for init in (ROOT / top).rglob("__init__.py"))
    return sorted(f"{package.relative_to(ROOT).as_posix()}/" for package in found)


def modules(package: str) -> set[str]:
    return {path.name for path in (ROOT / package).glob("*.py")}


def module_map() -> dict[str, set[str]]:
    """``{package path: the module names of its block}`` from the "Module map" section."""
    section = re.search(r"^## Module map\n(.*?)^## ", DOC.read_text(), re.M | re.S)
    assert section, f"{DOC.name} has no '## Module map' section"
    blocks = re.findall(r"^```\n(.*?)^```$", section[1], re.M | re.S)
    found: dict[str, set[str]] = {}
    for block in blocks:
        first, _, rest = block.partition("\n")
        assert first.strip() not in found, f"two blocks for {first.strip()} in the module map"
        found[first.strip()] = set(MODULE.findall(rest))
    return found


@pytest.mark.parametrize("package", packages())
def test_the_module_map_names_every_module_of(package: str) -> None:
    blocks = module_map()
    assert package in blocks, (
        f"{DOC.name}'s module map has no block for package {package}: add one whose first "
        f"line is {package!r}, naming its modules {sorted(modules(package))}"
    )
    missing = sorted(modules(package) - blocks[package])
    assert not missing, (
        f"{DOC.name}'s module map, block {package}, does not name {missing}: add a line for "
        "each (where it sits among the others, and what it holds)"
    )


def test_the_module_map_names_no_module_that_is_gone() -> None:
    gone = {
        package: sorted(names - modules(package))
        for package, names in module_map().items()
        if names - modules(package)
    }
    unknown = sorted(set(module_map()) - set(packages()))
    assert not unknown, f"{DOC.name}'s module map has blocks for no package: {unknown}"
    assert not gone, f"{DOC.name}'s module map names modules that do not exist: {gone}"


def test_every_module_the_document_names_exists() -> None:
    text = DOC.read_text()
    every = set().union(*(modules(package) for package in packages()))
    private = {name.removesuffix(".py") for name in every if name.startswith("_")}
    unknown = sorted(
        {name for name in MODULE.findall(text) if name not in every}
        | {path for path in PATH.findall(text) if not (ROOT / path).is_file()}
        | {f"{name}." for name in PRIVATE.findall(text) if name not in private}
    )
    assert not unknown, f"{DOC.name} names modules or files that do not exist: {unknown}"
