"""First-use mistakes end in one line that says what to do (issue 32, item 7), where
pgqueue's code runs: its CLI, a worker (pgqueue's receivers run in every ``celery``
process) and ``configure()``. Kombu's bare ``KeyError: 'No such transport: postgresql'``
left a user with a traceback and no way out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery
from celery_workers import workers
from kombu import Connection
from lifecycle_app import worker_env
from waiting import wait_for

import celery_pgqueue
from celery_pgqueue._worker import transport_hint

pytestmark = pytest.mark.celery

HERE = Path(__file__).resolve().parent
MISTAKE = "postgresql://app:secret@db.internal:5432/app"
ADVICE = "write pgqueue://app:**@db.internal:5432/app"


def _env(dsn: str, schema: str) -> dict[str, str]:
    return {**worker_env(dsn, schema), "PGQUEUE_BROKER_URL": MISTAKE}


def test_the_cli_says_what_to_write_instead_of_a_postgresql_url(dsn: str, schema: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "mistaken_app", "pgqueue", "queues"],
        cwd=HERE,
        env=_env(dsn, schema),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert ADVICE in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line


def test_a_worker_says_what_to_write_instead_of_a_postgresql_url(
    dsn: str, schema: str, tmp_path: Path
) -> None:
    with workers(tmp_path) as started:
        worker = started.start("mistaken_app", "mistaken", cwd=HERE, env=_env(dsn, schema))
        wait_for(lambda: worker.proc.poll() is not None, 60, "the worker to give up")
    assert ADVICE in worker.log()
    assert "secret" not in worker.log()


@pytest.mark.parametrize(
    "url, advice",
    [
        ("postgres://app@db/app", "write pgqueue://app@db/app"),
        ("postgresql+psycopg://app@db/app", "write pgqueue://app@db/app"),
        ("pgqueue://app@db/app", None),  # this process imported kombu_pgqueue
        ("redis://localhost:6379/0", None),
    ],
)
def test_transport_hint(url: str, advice: str | None) -> None:
    hint = transport_hint(Celery(broker=url, set_as_current=False))
    assert hint == advice or (advice is not None and hint is not None and advice in hint)


def test_configure_refuses_a_url_of_another_broker_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^configure\(\) takes a PostgreSQL .* not 'redis:") as e:
        celery_pgqueue.configure(Celery(set_as_current=False), "redis://localhost:6379/0")
    assert "\n" not in str(e.value)


def test_any_celery_command_says_what_to_write_instead_of_a_postgresql_url(
    dsn: str, schema: str
) -> None:
    """``celery call`` (as ``beat``, ``shell``, ``inspect``...) runs pgqueue's code too:
    Celery's CLI imports its ``celery pgqueue`` entry point."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "mistaken_app", "call", "proj.add"],
        cwd=HERE,
        env=_env(dsn, schema),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("KeyError: ") and "pgqueue:// in place of postgresql://" in last, last
    assert "secret" not in done.stderr


def test_a_web_process_that_imported_celery_pgqueue_says_it_at_its_first_delay(
    tmp_path: Path,
) -> None:
    code = (
        "import celery_pgqueue\n"  # for its atomic enqueue, say; the URL set by hand
        "from celery import Celery\n"
        f"app = Celery('web', broker={MISTAKE!r}, set_as_current=False)\n"
        "app.send_task('proj.add', (1, 2))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    last = done.stderr.strip().splitlines()[-1]
    assert "Kombu has no postgresql:// transport" in last, done.stderr
    assert "celery_pgqueue.configure(app, dsn)" in last


@pytest.mark.parametrize(
    "url", ["postgresql://app@db/app", "postgres://app@db/app", "postgresql+psycopg://app@db/app"]
)
def test_kombu_says_what_to_write_for_a_postgresql_url(url: str) -> None:
    with pytest.raises(KeyError, match=r"No such transport: postgres.*pgqueue:// in place"):
        Connection(url).get_transport_cls()  # Celery's first delay() gets there


def test_kombus_own_transport_names_are_left_alone() -> None:
    """pgqueue adds names Kombu has no transport for, and changes none of Kombu's (its
    pgmq:// and sqla+postgresql:// among them)."""
    listing = "import json; from kombu.transport import TRANSPORT_ALIASES as A; "
    code = listing + "print(json.dumps({k: v if isinstance(v, str) else 0 for k, v in A.items()}))"
    kombus = json.loads(subprocess.check_output([sys.executable, "-c", code], timeout=60))
    with_ours = json.loads(
        subprocess.check_output([sys.executable, "-c", "import kombu_pgqueue; " + code], timeout=60)
    )
    assert {k: with_ours[k] for k in kombus} == kombus
    assert set(with_ours) - set(kombus) == {"pgqueue", "postgresql", "postgres"}
