"""What one apply_async costs, back to back and after 30 ms idle, on any broker URL.

    python benchmarks/probes/publish_cost.py pgqueue://postgres@127.0.0.1/test
    python benchmarks/probes/publish_cost.py amqp://guest:guest@127.0.0.1:5672//

And a bare one-row INSERT with and without the WAL flush (the floor under a durable
publish): ``python benchmarks/probes/publish_cost.py --commit``.
"""

from __future__ import annotations

import statistics
import sys
import time

N = 200


def timed(call, gap: float) -> float:  # noqa: ANN001
    samples = []
    for _ in range(N):
        began = time.perf_counter()
        call()
        samples.append(time.perf_counter() - began)
        if gap:
            time.sleep(gap)
    return statistics.median(samples) * 1000


def main() -> None:
    if sys.argv[1:] == ["--commit"]:
        import psycopg

        with psycopg.connect("host=127.0.0.1 dbname=test user=postgres", autocommit=True) as c:
            c.execute("CREATE TABLE IF NOT EXISTS probe_commit (x int)")
            try:
                for commit in ("on", "off"):
                    c.execute(f"SET synchronous_commit = {commit}")
                    for gap in (0.0, 0.03):
                        ms = timed(lambda: c.execute("INSERT INTO probe_commit VALUES (1)"), gap)
                        print(
                            f"INSERT, synchronous_commit={commit}, gap {gap * 1000:.0f} ms: "
                            f"p50 {ms:.3f} ms"
                        )
            finally:
                c.execute("DROP TABLE probe_commit")
        return
    from celery import Celery

    import kombu_pgqueue  # noqa: F401 - registers pgqueue://

    app = Celery("probe", broker=sys.argv[1])
    app.conf.broker_transport_options = {"schema": "probe_s"}

    @app.task(name="probe")
    def probe() -> None:
        pass

    probe.apply_async()
    for gap in (0.0, 0.03):
        print(f"apply_async, gap {gap * 1000:.0f} ms: p50 {timed(probe.apply_async, gap):.3f} ms")


if __name__ == "__main__":
    main()
