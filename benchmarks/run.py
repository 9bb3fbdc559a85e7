#!/usr/bin/env python
"""``python benchmarks/run.py [options]``: the same as ``python -m benchmarks [options]``.

The harness is the package ``benchmarks`` (see README.md). Run from the repository root,
this file hands its arguments to ``python -m benchmarks`` (it replaces itself with that
process); it imports nothing from the package and changes no import path.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    command = [sys.executable, "-m", "benchmarks", *sys.argv[1:]]
    if os.path.realpath(os.getcwd()) != os.path.realpath(ROOT):
        sys.exit(
            f"run it from the repository root {ROOT}: python -m benchmarks {' '.join(sys.argv[1:])}"
        )
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
