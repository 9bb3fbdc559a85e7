"""The beat's metrics (issue 44): which beat leads, and sends, late ones apart, from the
exporter's collector (``celery_pgqueue.metrics``)."""

from __future__ import annotations

from datetime import timedelta

from celery import Celery
from periodic_app import T0, every
from prometheus_client import CollectorRegistry, generate_latest

from celery_pgqueue._schedules import Clock
from celery_pgqueue.beat import Scheduler
from celery_pgqueue.metrics import PgQueueCollector
from kombu_pgqueue import admin


def scrape(broker: admin.Broker) -> str:
    registry = CollectorRegistry()
    registry.register(PgQueueCollector(broker.monitor(), counters=False, min_interval=0))
    return generate_latest(registry).decode()


def test_beat_metrics_say_who_leads_and_count_late_sends(
    periodic: Celery, broker: admin.Broker
) -> None:
    assert "pgqueue_beat_leading 0.0" in scrape(broker)
    broker.save_periodic(every("late", 1.0), now=T0)
    clock = Clock()
    clock.now = T0 + timedelta(seconds=7.5)  # due times 1 to 7, two of them > 5 s late
    periodic.conf.pgqueue_beat_node = "node-a"
    beat = Scheduler(periodic, clock=clock)
    try:
        beat.tick()
        text = scrape(broker)
    finally:
        beat.close()
    assert "pgqueue_beat_leading 1.0" in text
    assert 'pgqueue_beat_leader{node="node-a"} 1.0' in text
    assert 'pgqueue_beat_sends_total{entry="late"} 7.0' in text
    assert 'pgqueue_beat_late_sends_total{entry="late"} 2.0' in text
    assert 'pgqueue_beat_last_lateness_seconds{entry="late"} 0.5' in text
    assert "pgqueue_beat_leading 0.0" in scrape(broker)  # closed: the lead is free
