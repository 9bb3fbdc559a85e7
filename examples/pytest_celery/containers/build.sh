#!/usr/bin/env bash
# Build the images of pytest-celery's container mode without an image registry:
#   pgqueue/bookworm:base      a Debian bookworm rootfs (mmdebstrap, Debian's archive)
#                              with PostgreSQL 15 and Python 3.11, `docker import`ed
#   pgqueue/postgres:15        the broker and result backend (postgres.Dockerfile)
#   pgqueue/celery-worker      a worker with kombu-pgqueue (worker.Dockerfile), from
#                              wheels built here of this checkout and its dependencies
# Needs a Docker engine, root (mmdebstrap), mmdebstrap, and a Python 3.11 with pip
# (PYTHON, default python3). The base is built once; the others are rebuilt (cached).
# DEBIAN_MIRROR picks the archive (default http://deb.debian.org/debian).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$here/../../.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! docker image inspect pgqueue/bookworm:base >/dev/null 2>&1; then
    mmdebstrap --variant=minbase \
        --include=postgresql-15,python3,python3-venv,ca-certificates,procps \
        bookworm "$work/base.tar" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    docker import "$work/base.tar" pgqueue/bookworm:base
    rm -f "$work/base.tar"
fi

docker build --quiet -t pgqueue/postgres:15 -f "$here/postgres.Dockerfile" "$here"

"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the wheels need Python 3.11"'
mkdir "$work/worker"
cp "$here/worker.Dockerfile" "$here/celery" "$work/worker/"
"$python" -m pip wheel --quiet --wheel-dir "$work/worker/wheels" "$checkout[celery]" pytest-celery
docker build --quiet -t pgqueue/celery-worker:latest -f "$work/worker/worker.Dockerfile" "$work/worker"
