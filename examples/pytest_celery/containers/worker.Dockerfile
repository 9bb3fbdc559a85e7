# A Celery worker for pytest-celery's container mode, with kombu-pgqueue installed from
# wheels that build.sh puts in the context (the image's Python is Debian's 3.11, so the
# wheels are built by a Python 3.11). pytest-celery mounts the worker's app, tasks and
# signals at /app and runs `celery -A app worker ...`: the `celery` here registers
# pgqueue:// first (pytest-celery's generated app.py imports only celery).
FROM pgqueue/bookworm:base
COPY wheels /wheels
RUN python3 -m venv /venv \
 && /venv/bin/pip install --no-cache-dir --no-index --find-links /wheels \
      "kombu-pgqueue[celery]" pytest-celery \
 && rm -rf /wheels \
 && useradd --create-home test_user
COPY celery /usr/local/bin/celery
ENV PATH=/usr/local/bin:/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
USER test_user
CMD ["celery", "-A", "app", "worker", "--loglevel=INFO", "-n", "celery_test_worker@%h", "-Q", "celery"]
