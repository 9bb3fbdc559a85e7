"""Run a command against a throwaway PostgreSQL of its own, then remove it.

    python benchmarks/probes/own_cluster.py -- python -m benchmarks --only publishers

The shared server on 5432 also serves other people's tests: their sessions that LISTEN
in the same database are signalled by every publish's NOTIFY, and their notifying
commits take the same cluster-wide lock as ours. This starts a cluster like the shared
one (``tests/clusters.py``: initdb in a temporary directory, another port; fsync and
synchronous_commit at PostgreSQL's defaults, ``shared_buffers`` 128MB as on the shared
server, ``max_connections`` 200) and runs the command with ``PGQUEUE_BENCH_DSN`` naming
its database ``test``, which the harness uses for the pgqueue brokers and its own
connection (peers are unchanged). The cluster is removed when the command ends.
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SETTINGS = {"shared_buffers": "128MB", "max_connections": "200"}


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        raise SystemExit(__doc__)
    from benchmarks.config import ROOT

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from clusters import Cluster

    with Cluster.primary(name="bench-own") as c:
        with c.connect() as conn:
            for key, value in SETTINGS.items():
                conn.execute(f"ALTER SYSTEM SET {key} = '{value}'")
        c.stop()
        c.start()
        c.create_database("test")
        dsn = f"host=127.0.0.1 port={c.port} user=postgres dbname=test"
        print(f"own cluster on port {c.port}: {dsn}", flush=True)
        env = {**os.environ, "PGQUEUE_BENCH_DSN": dsn}
        return subprocess.run(args, env=env, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
