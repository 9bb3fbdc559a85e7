"""The ``claim`` group (pgqueue only): Store.claim+ack cost against a shallow and a deep
backlog, after churn without vacuum, and after VACUUM; and the COPY loader it shares with
the ``bulk`` group."""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg

from .config import SMALL_BODY, Ctx, Settings, log
from .peers import Broker


def copy_rows(conn: psycopg.Connection, schema: str, queue: str, n: int) -> float:
    """COPY n small ready messages into queue; return rows/s."""
    body = "\\\\x" + (json.dumps(SMALL_BODY).encode().hex())
    headers = '{"id": "x"}'
    props = json.dumps(
        {"delivery_info": {"exchange": "", "routing_key": queue}, "body_encoding": "utf-8"}
    )
    line = f"{queue}\t{body}\tapplication/json\tutf-8\t{headers}\t{props}\n"
    chunk_rows = 10_000
    chunk = (line * chunk_rows).encode()
    t0 = time.perf_counter()
    with conn.cursor() as cur:
        stmt = psycopg.sql.SQL(
            "COPY {}.message_store"
            " (queue, body, content_type, content_encoding, headers, properties) "
            "FROM STDIN"
        ).format(psycopg.sql.Identifier(schema))
        with cur.copy(stmt) as copy:
            left = n
            while left > 0:
                k = min(left, chunk_rows)
                copy.write(chunk if k == chunk_rows else (line * k).encode())
                left -= k
    return n / (time.perf_counter() - t0)


def open_store(settings: Settings, broker: Broker):  # noqa: ANN201
    """kombu_pgqueue's Store (a private class) for the broker's schema, opened."""
    from kombu_pgqueue._options import build_conninfo, parse_options
    from kombu_pgqueue._store import Store

    f = settings.pg_fields()
    options = parse_options(broker.options)
    conninfo = build_conninfo(
        hostname=f["host"],
        port=f["port"],
        userid=f["user"],
        password=f["password"],
        virtual_host=f["dbname"],
    )
    store = Store(conninfo, options)
    store.open()
    return store


def claim_cost(store: Any, queue: str, limit: int, reps: int) -> float:
    """Mean ms of claim(limit) + ack of what it got, from the head of queue."""
    from kombu_pgqueue._store import new_lease

    total = 0.0
    for _ in range(reps):
        lease = new_lease()
        t0 = time.perf_counter()
        rows = store.claim(queue, limit, lease)
        if limit == 1:
            for r in rows:
                store.ack(r.id, lease)
        else:
            store.ack_many([r.id for r in rows], [lease] * len(rows))
        total += time.perf_counter() - t0
        if len(rows) < limit:
            raise RuntimeError(f"claim({limit}) on {queue} returned {len(rows)} rows")
    return total / reps * 1000.0


def _load_deep(ctx: Ctx, conn: psycopg.Connection, schema: str) -> None:
    deep_n = ctx.sizes["deep_n"]
    log(f"  pgqueue: COPY {deep_n:,} messages into {schema}.message_store (deep backlog)")
    rate = copy_rows(conn, schema, "deep", deep_n)
    delayed = deep_n // 10
    log(f"  pgqueue: loaded at {rate:,.0f} rows/s; {delayed:,} delayed ones beside them")
    conn.execute(
        psycopg.sql.SQL(
            "INSERT INTO {}.message_store (queue, delayed, next_iteration, body, content_type,"
            " content_encoding, headers, properties)"
            " SELECT 'deep', true, now() + interval '1 day' + n * interval '1 ms',"
            " '\\x7b7d', 'application/json', 'utf-8', '{{}}', '{{}}'"
            " FROM generate_series(1, %s) AS n"
        ).format(psycopg.sql.Identifier(schema)),
        (delayed,),
    )
    log("  pgqueue: VACUUM ANALYZE")
    conn.execute(
        psycopg.sql.SQL("VACUUM ANALYZE {}.message_store").format(psycopg.sql.Identifier(schema))
    )


def _churn(
    ctx: Ctx, conn: psycopg.Connection, store: Any, schema: str, out: dict[str, list[float]]
) -> None:
    """churn_n claims+acks from the head of the deep queue leave dead index entries in
    front of the live ones until (auto)vacuum runs: claim(1) then, and after VACUUM."""
    reps = ctx.sizes["claim_reps"]
    _autovacuum(conn, schema, "SET (autovacuum_enabled = off)")
    try:
        claim_cost(store, "deep", 100, ctx.sizes["churn_n"] // 100)
        out["claim1_churned"] = [claim_cost(store, "deep", 1, reps) for _ in range(ctx.runs)]
        holder = conn.execute(
            "SELECT pid, application_name, state, "
            "greatest(age(backend_xmin), age(backend_xid)), "
            "now() - xact_start, left(regexp_replace(query, '\\s+', ' ', 'g'), 60) "
            "FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() "
            "AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL) "
            "ORDER BY 4 DESC NULLS LAST LIMIT 1"
        ).fetchone()
        ctx.notes.append(
            "pgqueue: churn measured with autovacuum off for the table; oldest snapshot in the "
            + (
                "database then: none"
                if not holder
                else f"database then: {holder[3]} xids old, pid {holder[0]} "
                f"({holder[1] or 'no app name'}, "
                f"{holder[2]}, transaction open {holder[4]}, {holder[5]!r})"
            )
        )
        said: list[str] = []
        conn.add_notice_handler(lambda diag: said.append(diag.message_primary or ""))
        conn.execute(
            psycopg.sql.SQL("VACUUM (VERBOSE) {}.message_store").format(
                psycopg.sql.Identifier(schema)
            )
        )
        detail = [
            line.strip()
            for text in said
            for line in text.splitlines()
            if "removable" in line or "tuples:" in line
        ]
        if detail:
            ctx.notes.append("pgqueue: VACUUM after churn said: " + "; ".join(detail[:2]))
        out["claim1_vacuumed"] = [claim_cost(store, "deep", 1, reps) for _ in range(ctx.runs)]
    finally:
        _autovacuum(conn, schema, "RESET (autovacuum_enabled)")


def _autovacuum(conn: psycopg.Connection, schema: str, change: str) -> None:
    """ALTER each generation of the message table (the storage parameter is a leaf
    table's: a partitioned table refuses it)."""
    leaves = conn.execute(
        "SELECT relid::regclass::text FROM pg_partition_tree(%s) WHERE isleaf",
        (f'"{schema}".message_store',),
    ).fetchall()
    for (leaf,) in leaves:
        conn.execute(psycopg.sql.SQL("ALTER TABLE {} " + change).format(psycopg.sql.SQL(leaf)))


def bench_claim(ctx: Ctx, broker: Broker) -> dict[str, list[float]]:
    """Claim cost: small vs deep backlog, and after churn. Loads once, measures --runs times."""
    if broker.name != "pgqueue":
        return {}
    reps = ctx.sizes["claim_reps"]
    schema = broker.options["schema"]
    store = open_store(ctx.settings, broker)
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "claim1_shallow",
            "claim1_deep",
            "claim100_shallow",
            "claim100_deep",
            "drain_shallow",
            "drain_deep",
        )
    }
    with psycopg.connect(ctx.settings.dsn, autocommit=True) as conn:
        _load_deep(ctx, conn, schema)
        for r in range(ctx.runs):
            shallow = f"shallow{r}"
            copy_rows(conn, schema, shallow, 10_000)
            conn.execute(
                psycopg.sql.SQL("ANALYZE {}.message_store").format(psycopg.sql.Identifier(schema))
            )
            claim_cost(store, shallow, 1, 10)  # warm-up, prepares the statements
            claim_cost(store, "deep", 1, 10)
            out["claim1_shallow"].append(claim_cost(store, shallow, 1, reps))
            out["claim1_deep"].append(claim_cost(store, "deep", 1, reps))
            out["claim100_shallow"].append(claim_cost(store, shallow, 100, 20))
            out["claim100_deep"].append(claim_cost(store, "deep", 100, 20))
            out["drain_shallow"].append(100_000 / out["claim100_shallow"][-1])
            out["drain_deep"].append(100_000 / out["claim100_deep"][-1])
            store.delete_queue(shallow)
        _churn(ctx, conn, store, schema, out)
        store.delete_queue("deep")
    return out
