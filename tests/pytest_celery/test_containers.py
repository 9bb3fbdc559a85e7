"""pytest-celery's container mode on pgqueue (examples/pytest_celery/containers), run
for real: the images are built by its ``build.sh`` (a Debian rootfs, no registry) and
its conftest and tests run verbatim with pytest in a subprocess.

It needs a Docker engine, which CI lacks, so it is not in the default run (marker
``containers``): ``python -m pytest -m containers tests/pytest_celery/test_containers.py``
runs it, and fails, saying so, where no engine answers. With an engine, the first build
of the base image takes minutes (mmdebstrap); later builds are Docker's cache plus the
wheels.
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
pytestmark = pytest.mark.containers

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "pytest_celery" / "containers"


def docker_engine() -> str | None:
    """Why no Docker engine can be used here, or None when one answers."""
    import docker

    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # docker-py raises DockerException, requests' errors, ...
        return f"no Docker engine answers ({type(exc).__name__}): container mode cannot run"
    client.close()
    return None


def test_the_container_recipe_runs_a_users_tests_on_pgqueue_containers(
    pytester: pytest.Pytester,
) -> None:
    why = docker_engine()
    if why:
        pytest.fail(why, pytrace=False)  # asked for by -m containers: not a skip
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
