"""The Celery app: broker and results in Django's own database.

Run a worker:   celery -A shop worker -l info   (from examples/django_project)
"""

import os

from celery import Celery

import celery_pgqueue
import celery_pgqueue.django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
from django.conf import settings  # noqa: E402 - after DJANGO_SETTINGS_MODULE

app = Celery("shop")
# the DSN of DATABASES["default"]: the broker cannot be another database by mistake.
# No result backend: the tasks record what they did in the database.
celery_pgqueue.configure(
    app, celery_pgqueue.django.dsn(), results=False, schema=settings.PGQUEUE_SCHEMA
)
app.conf.update(worker_hijack_root_logger=False)
app.autodiscover_tasks()
