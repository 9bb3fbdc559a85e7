"""What keeping a handoff's message from strangers costs, two ways (issue 29).

    python benchmarks/probes/handoff_seal.py [ROUNDS]

1. Sealing: the publishing client seals the message with the schema's key (what
   kombu_pgqueue does, ``_handoffs.seal``), the consumer opens it (``parse_handoff``):
   microseconds of CPU per message, for an 837-byte Celery message, the median of ROUNDS
   (5) rounds of 20,000.
2. Fetching: the handoff carries only the id and lease, and the consumer reads the row
   by primary key: one round trip on a prepared connection, back to back (warm) and
   after 20 ms idle (cold, as an idle worker's pooled connection is when a handoff
   comes), the median and 90th percentile of 300.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")


def main() -> None:
    import psycopg
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kombu_pgqueue._handoffs import parse_handoff, seal, signature
    from kombu_pgqueue.records import Outgoing

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    body = os.urandom(600)
    headers = '{"lang": "py", "task": "proj.tasks.add", "id": "' + "x" * 36 + '"}'
    message = Outgoing(
        queue="celery",
        body=body,
        headers=headers,
        properties='{"priority": 0}',
        content_type="application/json",
        content_encoding="utf-8",
    )
    box = AESGCM(AESGCM.generate_key(bit_length=256))
    sealed = seal(box, message, 7)
    rest = f"0123456789abcdef:1:7:{time.time() + 60}:{sealed}"
    payload = f"{signature('s' * 32, rest)}:{rest}"
    for name, call in (
        ("seal", lambda: seal(box, message, 7)),
        ("open", lambda: parse_handoff(payload, "s" * 32, box)),
    ):
        per = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(20_000):
                call()
            per.append((time.perf_counter() - start) / 20_000 * 1e6)
        print(f"{name:6} {statistics.median(per):6.2f} us [{min(per):.2f}-{max(per):.2f}]")

    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(
            "CREATE TEMP TABLE m (id bigint PRIMARY KEY, lease bigint, body bytea, h text, p text)"
        )
        conn.execute(
            "INSERT INTO m SELECT g, g, %s, '{}', '{}' FROM generate_series(1, 1000) g", (body,)
        )
        query = "SELECT id, body, h, p FROM m WHERE id = ANY(%(ids)s) AND lease = ANY(%(ids)s)"
        for mode, idle in (("warm", 0.0), ("cold", 0.02)):
            took = []
            for i in range(300):
                if idle:
                    time.sleep(idle)
                start = time.perf_counter()
                conn.execute(query, {"ids": [i + 1]}, prepare=True).fetchall()
                took.append((time.perf_counter() - start) * 1e6)
            took.sort()
            print(f"fetch {mode}: p50 {statistics.median(took):.1f} us, p90 {took[269]:.1f} us")


if __name__ == "__main__":
    main()
