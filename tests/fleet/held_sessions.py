"""What sessions a process tree holds on the server (pg_stat_activity, by
application_name): the fleet tests' count."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo.extend(children.get(current, []))
    return found


class Sessions:
    """The server sessions of processes started with this object's ``PGAPPNAME``."""

    def __init__(self, db: psycopg.Connection) -> None:
        self.db = db
        self.appname = f"fleet-{uuid.uuid4().hex[:8]}"

    def env(self) -> dict[str, str]:
        return {"PGAPPNAME": self.appname}

    def of(self, pid: int) -> list[str]:
        """The application names of the sessions ``pid`` and its children hold."""
        names = [f"pgqueue[{p}]" for p in process_tree(pid)] + [self.appname]
        rows = self.db.execute(
            "SELECT application_name FROM pg_stat_activity"
            " WHERE application_name = ANY(%s) AND backend_type = 'client backend'"
            " ORDER BY 1",
            (names,),
        ).fetchall()
        return [name for (name,) in rows]


def listening(db: psycopg.Connection, names: list[str]) -> int:
    """How many of the sessions named ``names`` (application_name) wait for queues: hold
    a shared advisory lock of statement watch's, as LISTEN sessions do."""
    row = db.execute(
        "SELECT count(DISTINCT l.pid) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock'"
        " AND a.application_name = ANY(%s)",
        (names,),
    ).fetchone()
    assert row is not None
    return int(row[0])
