"""A/B: what the client-side statement deadline costs a publisher.

    python benchmarks/probes/deadline_ab.py [ROUNDS] [SECONDS]

Every pooled statement is armed with a deadline (``kombu_pgqueue._deadline``), and arming
it wakes the watchdog thread whenever nothing else was armed, i.e. on every statement of
a process that publishes one message at a time. The other variant turns the deadline off
(``statement_timeout: 0``; PostgreSQL's own ``statement_timeout`` goes with it, which
does not matter here). 1 and 8 processes call ``apply_async`` (``scale.Fleet``) for
SECONDS (5) per window, the variants alternated, ROUNDS (4) times, against the local
server (schema ``probe_dl``), with and without ``synchronous_commit: "off"``; prints
tasks/s and the publishers' CPU per task (median [min-max]).
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

URL = "pgqueue://postgres@127.0.0.1:5432/test"
SCHEMA = "probe_dl"


def main() -> None:
    import psycopg

    from benchmarks.scale import Fleet

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    variants = {
        "deadline (as shipped)": {"schema": SCHEMA},
        "no deadline": {"schema": SCHEMA, "statement_timeout": 0},
    }
    found: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    try:
        for commit in ("on", "off"):
            for procs in (1, 8):
                fleets = {}
                for name, options in variants.items():
                    if commit == "off":
                        options = {**options, "synchronous_commit": "off"}
                    fleets[name] = Fleet(URL, options, "probe_dl_q", procs, "celery")
                try:
                    for r in range(rounds):
                        order = list(fleets) if r % 2 == 0 else list(reversed(fleets))
                        for name in order:
                            w = fleets[name].run(seconds)
                            us = w.client_cpu / w.published * 1e6
                            found.setdefault((commit, procs, name), []).append((w.rate, us))
                            print(
                                f"commit {commit:3s} {procs} procs, {name:22s}: "
                                f"{w.rate:6.0f} tasks/s, {us:4.0f} us CPU per task",
                                flush=True,
                            )
                finally:
                    for fleet in fleets.values():
                        fleet.close()
    finally:
        with psycopg.connect("host=127.0.0.1 dbname=test user=postgres", autocommit=True) as c:
            c.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    print(f"\n{rounds} rounds of {seconds:g} s: median [min-max]")
    for (commit, procs, name), vals in found.items():
        rates, cpus = [v[0] for v in vals], [v[1] for v in vals]
        print(
            f"  synchronous_commit {commit:3s}, {procs} procs, {name:22s}: "
            f"{statistics.median(rates):6.0f} tasks/s [{min(rates):.0f}-{max(rates):.0f}], "
            f"CPU {statistics.median(cpus):4.0f} us per task [{min(cpus):.0f}-{max(cpus):.0f}]"
        )


if __name__ == "__main__":
    main()
