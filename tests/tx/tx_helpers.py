"""``make_app``: the name ``test_dedup`` imports for the one Celery app factory, which is
``celery_app`` in ``tests/celery_apps.py`` (wait with ``tests/waiting.py``)."""

from __future__ import annotations

from celery_apps import celery_app as make_app

__all__ = ["make_app"]
