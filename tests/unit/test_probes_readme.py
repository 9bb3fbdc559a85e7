"""benchmarks/probes/README.md lists every probe script of its folder, and names none
that is not there (a probe added without a line there, or removed or renamed and
still listed, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"
README = PROBES / "README.md"

#: a script's file name standing alone (``hops.py``), not a path into another folder
#: (``tests/unit/test_probes_readme.py``) nor part of a longer name
SCRIPT_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|sh))\b")


def scripts() -> set[str]:
    return {p.name for p in PROBES.iterdir() if p.is_file() and p.name != README.name}


def named() -> set[str]:
    return set(SCRIPT_NAME.findall(README.read_text()))


def test_every_probe_script_is_in_the_readme() -> None:
    assert scripts(), f"no probe scripts found in {PROBES}"
    assert sorted(scripts() - named()) == []


def test_every_script_the_readme_names_is_in_the_folder() -> None:
    assert sorted(named() - scripts()) == []
