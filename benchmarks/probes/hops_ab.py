"""Interleaved runs of hops.py: each configuration once per round, ROUNDS rounds.

    python benchmarks/probes/hops_ab.py ROUNDS N CONFIG...

A CONFIG is hops.py's arguments joined by commas: ``pgqueue``, ``rabbitmq,--wait,block``,
``pgqueue,--fake-claim``. Prints, per configuration and hop, the median over the rounds of
each run's p50 (and p95) with the range, and appends every run's JSON to
/tmp/hops_ab.jsonl. ``uptime`` is printed before every run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HOPS = ("pub_start", "pub_end", "ret", "woke", "notified", "claim_start", "exec_start",
        "exec_end", "claim_end", "hand_out", "deliver", "apply", "child_recv",
        "task_start", "less_claim")  # fmt: skip


def run(config: str, n: int) -> dict:
    args = config.split(",")
    args.insert(1, str(n))
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "hops.py"), *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("JSON "):
            result = json.loads(line[5:])
            result["config"], result["uptime"] = config, up
            with open("/tmp/hops_ab.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
            print(f"{config:32} task_start p50 {result['task_start']['p50']:.2f} | {up}")
            return result
    raise RuntimeError(f"{config}: {out.stdout[-2000:]} {out.stderr[-2000:]}")


def fmt(vals: list[float]) -> str:
    return f"{statistics.median(vals):.2f} [{min(vals):.2f}-{max(vals):.2f}]"


def main() -> None:
    rounds, n, configs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(rounds):
        for config in configs:
            results[config].append(run(config, n))
    for config, runs in results.items():
        print(f"\n## {config} ({len(runs)} runs of {n})")
        print("| hop | p50 since apply_async | p95 | hop's own p50 | hop's own p95 |")
        print("|---|---|---|---|---|")
        for hop in HOPS:
            have = [r[hop] for r in runs if hop in r]
            if len(have) < len(runs):
                continue
            own = [h["hop_p50"] for h in have if "hop_p50" in h]
            own95 = [h["hop_p95"] for h in have if "hop_p95" in h]
            print(
                f"| {hop} | {fmt([h['p50'] for h in have])} | {fmt([h['p95'] for h in have])} "
                f"| {fmt(own) if own else ''} | {fmt(own95) if own95 else ''} |"
            )
        p99 = [r["task_start"]["p99"] for r in runs]
        cpu = [r["driver_cpu_ms_per_task"] for r in runs]
        print(f"task_start p99 {fmt(p99)}; driver CPU ms per task {fmt(cpu)}")


if __name__ == "__main__":
    main()
