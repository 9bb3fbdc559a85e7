"""Settings: one PostgreSQL for Django, the Celery broker and the results.

``PGQUEUE_DSN`` names it; without it an embedded PostgreSQL is started (and its
DSN exported, so that the worker this process starts uses the same server).
"""

import os

import celery_pgqueue.django
from kombu_pgqueue import embedded

PGQUEUE_DSN = os.environ.get("PGQUEUE_DSN") or embedded.start()
os.environ["PGQUEUE_DSN"] = PGQUEUE_DSN
PGQUEUE_SCHEMA = os.environ.get("PGQUEUE_SCHEMA", "pgqueue")

DATABASES = {"default": celery_pgqueue.django.database_settings(PGQUEUE_DSN)}
INSTALLED_APPS = ["orders"]
ROOT_URLCONF = "shop.urls"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
SECRET_KEY = "example-only-not-secret"  # noqa: S105
DEBUG = False
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
