"""An app with a first-use mistake in its broker URL, for ``celery -A mistaken_app ...``:
``broker_url`` is ``PGQUEUE_BROKER_URL`` as the user wrote it (``postgresql://...``,
which Kombu has no transport for), set by hand without ``configure()``."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("mistaken", broker=os.environ["PGQUEUE_BROKER_URL"], set_as_current=False)
