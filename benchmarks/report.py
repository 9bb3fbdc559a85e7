"""The report: the table of figures with pgqueue / peer ratios, the method, the machine, the
notes and problems; as text on stdout and optionally as Markdown and JSON files."""

from __future__ import annotations

import io
import json
import os
import platform
import statistics
import subprocess
import time

import psycopg

from .bench_app import COMMON_SETTINGS
from .config import ROOT, WORKER_FLAGS, Ctx
from .figures import FIGURES, GROUP_FIGURES, ONLY_FOR, VARIANT_GROUPS
from .orchestrate import Results


def fmt(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def cell(vals: list[float] | None) -> str:
    if not vals:
        return ""
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt(med)
    return f"{fmt(med)} [{fmt(min(vals))}-{fmt(max(vals))}]"


#: pgqueue's opt-in variants (benchmarks/peers.py), shown with ratios of their own
VARIANTS = ("pgqueue_async", "pgqueue_fast", "pgqueue_relay")


def build_table(ctx: Ctx, results: Results, groups: list[str]) -> list[list[str]]:
    names = list(ctx.brokers)
    peers = [n for n in names if not n.startswith("pgqueue")]
    # the opt-in variants, each with its ratios against the peers beside pgqueue's
    variants = [n for n in VARIANTS if n in names]
    header = ["figure", "unit", "better"] + names + [f"pg/{p}" for p in peers]
    for variant in variants:
        header += [f"{variant.removeprefix('pgqueue_')}/{p}" for p in peers]
    rows = [header]
    for group in groups:
        for key in GROUP_FIGURES[group]:
            label, unit, better = FIGURES[key]
            label = label.replace("churn_n", f"{ctx.sizes['churn_n'] // 1000}k")
            row = [label, unit, better]
            per = results.get(key, {})
            for n in names:
                b = ctx.brokers[n]
                if not b.available:
                    row.append("absent")
                elif group in ONLY_FOR and n not in ONLY_FOR[group]:
                    row.append("n/a")
                elif n in (*VARIANTS, "rabbitmq_confirm") and group not in VARIANT_GROUPS:
                    row.append("n/a")
                elif not per.get(n):
                    row.append(
                        "FAILED" if group not in ("claim", "bulk") or n == "pgqueue" else "n/a"
                    )
                else:
                    row.append(cell(per[n]))
            for ours in ["pgqueue", *variants]:
                pg = per.get(ours)
                for p in peers:
                    pv = per.get(p)
                    if pg and pv and statistics.median(pv) > 0:
                        row.append(f"{statistics.median(pg) / statistics.median(pv):.2f}")
                    else:
                        row.append("-")
            rows.append(row)
    return rows


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(widths[i]) if i < 3 else c.rjust(widths[i]) for i, c in enumerate(r))
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


METHOD = """\
Method
- Every figure: median of --runs runs [min-max]; ratio = pgqueue median / peer median
  (for "higher" figures above 1 favours pgqueue, for "lower" figures below 1 does).
  Brokers are interleaved within each run, so background load hits all of them alike.
- Kombu: Producer.publish (default exchange, ~90-byte JSON body) in one process after 100
  warm-up messages, then a Consumer with prefetch_count=100 drains that backlog, acking
  each message. For pgqueue the table is checked to be empty afterwards.
- Celery publish: apply_async() of a no-op task from one process (json, no results),
  after 20 warm-up calls. Slow brokers publish what fits in a time cap.
- Celery drain: that backlog is published first, then
  `python -m celery -A benchmarks.bench_app worker --pool P -c C --without-mingle
  --without-gossip` starts. Worker signal handlers append one line per task (task_prerun
  time, task_postrun time, task id) to a local file with a single O_APPEND write - no
  network, identical for every broker. Rate = tasks / (last postrun - first prerun);
  worker start-up is excluded. Every task id must appear (lost tasks are reported),
  duplicates are reported.
- Latency: the prefork -c 2 worker, once it has drained its backlog and idled 1 s; the
  producer passes time.time() as the argument, the task appends its own time.time() at
  start to the same file; sequential, 50 ms apart, 5 warm-up tasks dropped. Includes the
  apply_async call itself. Slow brokers stop at a time cap (at least a minimum sample).
- Idle cost (PostgreSQL brokers only): an idle prefork -c 2 worker per broker, side by
  side, each connected through its own counting proxy (pgproxy.py) that parses the client
  side of the wire protocol, so only that worker's traffic is counted (pg_stat_statements
  is not loaded on this server and pg_stat_database counts every session). Statements =
  Query + Execute messages; round trips = Query + Sync messages; counted over a fixed
  window after a settle period; connections = server connections open at the end.
  Statements include BEGIN/COMMIT/SET and, for every broker alike, Celery's worker
  heartbeat event (a publish every 2 s; the worker runs without --without-heartbeat).
- claim (pgqueue only): kombu_pgqueue._store.Store.claim + ack (or ack_many) from the head
  of a queue, mean over many calls, against a backlog COPY-loaded straight into the
  benchmark schema's message table and VACUUM ANALYZEd; then 50k claims+acks from the
  head with autovacuum off for the table, measured again, then after a manual VACUUM.
- bulk (pgqueue only): Store.publish_rows in batches of 10,000 rows, each with its own
  dedup key (the Kombu-level bulk path: COPY straight into the table, falling back to
  staging + INSERT ... ON CONFLICT when a key is taken); celery_pgqueue send_many of
  no-op signatures built beforehand (message building included); raw COPY for reference.
- ETA RSS: summed VmRSS of the worker's process group (prefork -c 2) with an empty
  queue, then after apply_async(countdown=86400) of N no-op tasks once the worker settles
  (broker queue empty and RSS flat 5 s, or nothing changing for 10 s, or a time cap);
  "held" = tasks no longer waiting in the broker's queue, i.e. in the worker's memory."""


def code_state() -> str:
    """kombu_pgqueue's commit, and a digest of its uncommitted changes if any."""
    import hashlib

    try:
        head = subprocess.run(
            ["git", "-C", ROOT, "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", ROOT, "diff", "HEAD", "--", "kombu_pgqueue"],
            capture_output=True,
            timeout=5,
        ).stdout
        state = f"kombu_pgqueue at {head[:90]}"
        if diff:
            state += f" + uncommitted changes (diff {hashlib.sha1(diff).hexdigest()[:8]})"
        return state
    except Exception:  # noqa: BLE001
        return "kombu_pgqueue: git state unknown"


def machine_info(ctx: Ctx) -> list[str]:
    import celery
    import kombu
    import sqlalchemy

    try:
        import redis as redis_lib

        redis_version = redis_lib.__version__
    except ImportError:
        redis_version = "absent"

    info = [
        f"command: {ctx.command}",
        ctx.code_at_start,
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"host: {platform.platform()}, nproc={os.cpu_count()}",
        f"python {platform.python_version()}, celery {celery.__version__}, "
        f"kombu {kombu.__version__}, "
        f"redis-py {redis_version}, psycopg {psycopg.__version__}, "
        f"sqlalchemy {sqlalchemy.__version__}",
    ]
    try:
        free = subprocess.run(["free", "-h"], capture_output=True, text=True, timeout=5).stdout
        info.append("memory: " + " ".join(free.splitlines()[1].split()[1:3]) + " (total, used)")
    except Exception:  # noqa: BLE001,S110
        pass
    try:
        with psycopg.connect(ctx.settings.dsn) as conn:
            info.append("server: " + conn.execute("SELECT version()").fetchone()[0])
            settings = conn.execute(
                "SELECT string_agg(name || '=' || setting, ', ' ORDER BY name) FROM pg_settings "
                "WHERE name IN ('shared_buffers','synchronous_commit','fsync','max_connections')"
            ).fetchone()[0]
            info.append("server settings: " + settings)
    except Exception as exc:  # noqa: BLE001
        info.append(f"server: ? ({exc!r})")
    if "redis" in ctx.brokers and ctx.brokers["redis"].available:
        try:
            r = redis_lib.Redis.from_url(ctx.brokers["redis"].url)
            info.append(f"server: Redis {r.info('server')['redis_version']}")
        except Exception:  # noqa: BLE001,S110
            pass
    if "rabbitmq" in ctx.brokers and ctx.brokers["rabbitmq"].version:
        v = ctx.brokers["rabbitmq"].version
        info.append("server: " + (v if isinstance(v, str) else str(v)))
    info.append(
        "celery settings (all brokers): "
        + ", ".join(f"{k}={v!r}" for k, v in COMMON_SETTINGS.items())
    )
    info.append("worker flags (all brokers): " + " ".join(WORKER_FLAGS))
    return info


def write_report(
    ctx: Ctx,
    results: Results,
    groups: list[str],
    elapsed: float,
    markdown: str | None = None,
    json_path: str | None = None,
) -> None:
    """Print the report; also write it as Markdown and the raw numbers as JSON if asked."""
    rows = build_table(ctx, results, groups)
    info = machine_info(ctx)
    brokers = ctx.brokers.values()
    absent = [f"{b.name}: absent ({b.why_absent})" for b in brokers if not b.available]
    sizes_line = f"sizes: {ctx.sizes}; runs: {ctx.runs}; wall time {elapsed / 60:.1f} min"
    text = io.StringIO()
    print("", file=text)
    for line in info:
        print(line, file=text)
    print(sizes_line, file=text)
    print("", file=text)
    print(render_text(rows), file=text)
    print("", file=text)
    print(METHOD, file=text)
    for line in absent:
        print(line, file=text)
    if ctx.notes:
        print("\nNotes", file=text)
        for note in dict.fromkeys(ctx.notes):
            print("- " + note, file=text)
    if ctx.problems:
        print("\nPROBLEMS", file=text)
        for p in ctx.problems:
            print("- " + p, file=text)
    print(text.getvalue())

    if markdown:
        with open(markdown, "w") as f:
            f.write("```\n" + "\n".join(info) + f"\n{sizes_line}\n```\n\n")
            f.write(render_markdown(rows) + "\n\n```\n" + METHOD + "\n```\n")
            if absent or ctx.notes or ctx.problems:
                f.write(
                    "\n"
                    + "\n".join(
                        "- " + x
                        for x in absent
                        + list(dict.fromkeys(ctx.notes))
                        + ["PROBLEM " + p for p in ctx.problems]
                    )
                    + "\n"
                )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "sizes": ctx.sizes,
                    "runs": ctx.runs,
                    "results": results,
                    "problems": ctx.problems,
                    "notes": ctx.notes,
                    "info": info,
                },
                f,
                indent=1,
            )
