"""``celery pgqueue schedule list|add|pause|resume|remove`` as a user runs it (issue 44),
with a real ``celery beat`` picking the changes up without a restart."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from subprocess import CompletedProcess

import psycopg
import pytest
from celery_workers import Workers
from periodic_app import HERE, process_env, sent
from waiting import wait_for

from kombu_pgqueue import admin

Cli = Callable[..., CompletedProcess[str]]


def listed(cli: Cli) -> dict[str, dict[str, object]]:
    found = json.loads(cli("schedule", "list", "--json").stdout)
    return {entry["name"]: entry for entry in found["entries"]}


def test_schedule_add_list_pause_resume_remove(cli: Cli, periodic: object) -> None:
    assert "leader: none" in cli("schedule", "list").stdout
    assert cli("schedule", "add", "report", "app.report", "--crontab", "0 4 * * 1").stdout == (
        "report: added\n"
    )
    added = cli(
        "schedule", "add", "ping", "app.ping", "--every", "30", "--args", "[1, 2]",
        "--queue", "io", "--missed", "skip",
    )  # fmt: skip
    assert added.stdout == "ping: added\n"
    assert cli("schedule", "add", "ping", "app.ping", "--every", "30", "--args", "[1, 2]",
               "--queue", "io", "--missed", "skip").stdout == "ping: unchanged\n"  # fmt: skip
    assert cli("schedule", "add", "ping", "app.ping", "--every", "10").stdout == "ping: changed\n"
    entries = listed(cli)
    assert entries["report"]["schedule"] == {
        "kind": "crontab", "minute": "0", "hour": "4", "day_of_month": "*",
        "month_of_year": "*", "day_of_week": "1",
    }  # fmt: skip
    assert (entries["ping"]["args"], entries["ping"]["options"]) == ([], {})
    assert entries["ping"]["next_run_at"] != "-"
    assert cli("schedule", "pause", "ping").stdout == "ping: paused\n"
    text = cli("schedule", "list").stdout
    assert "every 10s" in text and "paused" in text and "cron 0 4 * * 1" in text
    assert listed(cli)["ping"]["next_run_at"] == "-"
    assert cli("schedule", "resume", "ping").stdout == "ping: resumed\n"
    refused = cli("schedule", "resume", "ping", ok=False)
    assert refused.returncode != 0 and "no paused periodic entry named 'ping'" in refused.stderr
    assert cli("schedule", "remove", "ping").stdout == "ping: removed\n"
    assert sorted(listed(cli)) == ["report"]
    wrong = cli("schedule", "add", "x", "app.x", "--every", "1", "--crontab", "* * * * *", ok=False)
    assert wrong.returncode != 0 and "one of --every, --crontab, --solar" in wrong.stderr


@pytest.mark.celery
def test_a_running_beat_takes_changes_from_the_cli_without_a_restart(
    cli: Cli, dsn: str, schema: str, periodic: object, broker: admin.Broker,
    db: psycopg.Connection, beats: Workers, tmp_path: Path,
) -> None:  # fmt: skip
    beat = beats.run(
        "beat", ["-A", "periodic_app", "beat", "-l", "info", "-s", str(tmp_path / "b.db")],
        cwd=HERE, env=process_env(dsn, schema, node="beat"),
    )  # fmt: skip
    wait_for(broker.beat_leader, 30, "the beat to lead", beat)
    assert "leader: beat (since" in cli("schedule", "list").stdout

    def sends(name: str, at_least: int) -> bool:
        return sum(s.entry == name for s in sent(db, schema)) >= at_least

    cli("schedule", "add", "fast", "periodic.tick", "--every", "0.5")
    wait_for(partial(sends, "fast", 2), 10, "two sends of the new entry", beat)
    cli("schedule", "pause", "fast")
    paused_at = sum(s.entry == "fast" for s in sent(db, schema))
    # a send on its way held the row, and the pause waited for it: none after it
    wait_for(partial(sends, "fast", paused_at + 1), 3, "a send after the pause", beat, never=True)
    cli("schedule", "add", "fast", "periodic.tick", "--every", "0.25")
    cli("schedule", "resume", "fast")
    count = sum(s.entry == "fast" for s in sent(db, schema))
    wait_for(partial(sends, "fast", count + 4), 5, "four sends at the new rate", beat)
    entry = listed(cli)["fast"]
    assert entry["schedule"] == {"kind": "interval", "every": 0.25, "relative": False}
    assert entry["last_run_at"] != "-"
