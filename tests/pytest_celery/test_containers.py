"""pytest-celery's container mode on pgqueue (examples/pytest_celery/containers), run
for real: the images are built by its ``build.sh`` (a Debian rootfs, no registry) and
its conftest and tests run verbatim with pytest in a subprocess.

A container test, not a database test: it needs a Docker engine and skips, saying so,
only when none answers (CI has none). With an engine, the first build of the base image
takes minutes (mmdebstrap); later builds are Docker's cache plus the wheels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("pytest_celery", reason="pip install '.[pytest-celery]'")

pytest_plugins = ("pytester",)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "pytest_celery" / "containers"


def docker_engine() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    import docker

    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # docker-py raises DockerException, requests' errors, ...
        return f"no Docker engine answers ({type(exc).__name__}): container mode not run"
    client.close()
    return None


def test_the_container_recipe_runs_a_users_tests_on_pgqueue_containers(
    pytester: pytest.Pytester,
) -> None:
    why = docker_engine()
    if why:
        pytest.skip(why)
    build = subprocess.run(
        [str(RECIPE / "build.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    for name in ("conftest.py", "test_on_containers.py", "pytest.ini"):
        (pytester.path / name).write_text((RECIPE / name).read_text())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(passed=2)
