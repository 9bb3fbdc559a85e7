"""The figures, the groups they are measured in, and the brokers each group applies to."""

from __future__ import annotations

from collections.abc import Mapping

# key -> (label, unit, better) ; better is "higher" or "lower"
FIGURES: Mapping[str, tuple[str, str, str]] = {
    "kombu_publish": ("Kombu publish, 1 process", "msg/s", "higher"),
    "kombu_consume": ("Kombu consume+ack, prefetch 100", "msg/s", "higher"),
    "celery_publish": ("Celery apply_async, 1 process", "tasks/s", "higher"),
    "drain_prefork": ("Celery drain, prefork -c 2", "tasks/s", "higher"),
    "drain_threads": ("Celery drain, threads -c 8", "tasks/s", "higher"),
    "latency_p50": ("Latency apply_async->start p50", "ms", "lower"),
    "latency_p95": ("Latency apply_async->start p95", "ms", "lower"),
    "latency_p99": ("Latency apply_async->start p99", "ms", "lower"),
    "idle_stmts": ("Idle worker: statements sent", "stmt/s", "lower"),
    "idle_trips": ("Idle worker: round trips", "trips/s", "lower"),
    "idle_conns": ("Idle worker: server connections held", "conns", "lower"),
    "claim1_shallow": ("claim(1)+ack, 10k backlog", "ms", "lower"),
    "claim1_deep": ("claim(1)+ack, deep backlog", "ms", "lower"),
    "claim100_shallow": ("claim(100)+ack_many, 10k backlog", "ms", "lower"),
    "claim100_deep": ("claim(100)+ack_many, deep backlog", "ms", "lower"),
    "drain_shallow": ("drain by claim(100)+ack_many, 10k backlog", "msg/s", "higher"),
    "drain_deep": ("drain by claim(100)+ack_many, deep backlog", "msg/s", "higher"),
    "claim1_churned": ("claim(1)+ack after churn_n acks, no vacuum", "ms", "lower"),
    "claim1_vacuumed": ("claim(1)+ack, same, after VACUUM", "ms", "lower"),
    "bulk_publish_rows": (
        "Store.publish_rows, batches of 10,000, dedup keys",
        "msg/s",
        "higher",
    ),
    "bulk_send_many": ("celery_pgqueue send_many, no-op signatures", "tasks/s", "higher"),
    "bulk_copy": ("COPY into the message table", "msg/s", "higher"),
    "rss_empty": ("Worker RSS (prefork -c 2), empty queue", "MB", "lower"),
    "rss_eta": ("Worker RSS with ETA tasks due tomorrow", "MB", "lower"),
    "eta_held": ("ETA tasks held in worker memory", "tasks", "lower"),
}

GROUPS = ("kombu", "celery_publish", "drain", "latency", "idle", "claim", "bulk", "eta_rss")
GROUP_FIGURES: Mapping[str, tuple[str, ...]] = {
    "kombu": ("kombu_publish", "kombu_consume"),
    "celery_publish": ("celery_publish",),
    "drain": ("drain_prefork", "drain_threads"),
    "latency": ("latency_p50", "latency_p95", "latency_p99"),
    "idle": ("idle_stmts", "idle_trips", "idle_conns"),
    "claim": (
        "claim1_shallow",
        "claim1_deep",
        "claim100_shallow",
        "claim100_deep",
        "drain_shallow",
        "drain_deep",
        "claim1_churned",
        "claim1_vacuumed",
    ),
    "bulk": ("bulk_publish_rows", "bulk_send_many", "bulk_copy"),
    "eta_rss": ("rss_empty", "rss_eta", "eta_held"),
}
#: figures that only exist for some brokers
ONLY_FOR: Mapping[str, frozenset[str]] = {
    "idle": frozenset({"pgqueue", "sqla"}),
    "claim": frozenset({"pgqueue"}),
    "bulk": frozenset({"pgqueue"}),
    "eta_rss": frozenset({"pgqueue", "redis", "rabbitmq"}),
}
#: the opt-in asynchronous-commit variant is measured where publishing matters
VARIANT_GROUPS = frozenset({"kombu", "celery_publish", "drain", "latency"})

# the scale groups: many publishers (scale.py), many listening workers (listeners.py)
from .listeners import LISTENER_FIGURES  # noqa: E402
from .scale import PUBLISHER_FIGURES  # noqa: E402

FIGURES = {**FIGURES, **PUBLISHER_FIGURES, **LISTENER_FIGURES}
GROUPS = (*GROUPS, "publishers", "listeners")
GROUP_FIGURES = {**GROUP_FIGURES, "publishers": tuple(PUBLISHER_FIGURES)}
GROUP_FIGURES = {**GROUP_FIGURES, "listeners": tuple(LISTENER_FIGURES)}
ONLY_FOR = {**ONLY_FOR, "listeners": frozenset({"pgqueue"})}
VARIANT_GROUPS = VARIANT_GROUPS | {"publishers"}

# exactly-once effects: AtomicTask against acks_late tasks (atomic_drain.py)
from .atomic_drain import ATOMIC_FIGURES  # noqa: E402

FIGURES = {**FIGURES, **ATOMIC_FIGURES}
GROUPS = (*GROUPS, "atomic")
GROUP_FIGURES = {**GROUP_FIGURES, "atomic": tuple(ATOMIC_FIGURES)}
ONLY_FOR = {**ONLY_FOR, "atomic": frozenset({"pgqueue"})}

# a fleet of idle workers within a managed server's connection limit (fleet.py)
from .fleet import FLEET_FIGURES  # noqa: E402

FIGURES = {**FIGURES, **FLEET_FIGURES}
GROUPS = (*GROUPS, "fleet")
GROUP_FIGURES = {**GROUP_FIGURES, "fleet": tuple(FLEET_FIGURES)}
ONLY_FOR = {**ONLY_FOR, "fleet": frozenset({"pgqueue"})}
