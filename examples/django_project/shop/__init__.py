"""A Django project whose Celery broker is its own database."""

from .celery import app as celery_app

__all__ = ["celery_app"]
