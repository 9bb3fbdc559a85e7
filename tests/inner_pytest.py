"""pytest inside a test (``pytester``), on a user's files: the plugin's and the
pytest-celery adapter's tests, and the recipes of docs/testing.md run as written.

Importable from every test directory (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: the page whose recipes the tests run verbatim
TESTING_DOCS = Path(__file__).resolve().parents[1] / "docs" / "testing.md"

#: seconds an inner run may take (it starts workers, and maybe an embedded server)
INNER_TIMEOUT = 300


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """An inner pytest in a process of its own, without the cache plugin."""
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=INNER_TIMEOUT)


def recipe_files(markdown: str, heading: str) -> dict[str, str]:
    """The code blocks under ``heading`` whose first line is ``# <path>``: {path: text}."""
    section = markdown.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        found = re.fullmatch(r"# (\S+\.py)\b.*", block.partition("\n")[0])
        if found:
            files[found.group(1)] = block
    return files


def lay_out(pytester: pytest.Pytester, files: dict[str, str]) -> None:
    """Write ``files`` ({relative path: text}, as :func:`recipe_files` gives them) into
    the inner run's directory, making folders as needed."""
    for name, text in files.items():
        path = pytester.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
