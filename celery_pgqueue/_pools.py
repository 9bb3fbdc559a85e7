"""What a worker's pool changes in its pgqueue transport, set as the worker starts.

Celery's solo pool runs each task inside the worker's event loop: while a task runs,
the worker reads nothing. A message handed off to it then (docs/lifecycle.md,
"Handoff") would wait behind that task while other workers idle, so a solo worker
takes no handoffs (transport option ``handoff`` False): it is woken, and claims, once
its loop is back, like any consumer, and publishes hand messages to workers of other
pools. An app that sets ``handoff`` itself keeps its choice.

Every ``celery`` command imports this package (its ``celery pgqueue`` command is an
entry point), so the receiver is connected in every worker started from the command
line; a worker started from Python connects it by importing ``celery_pgqueue``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from celery import signals
from celery.concurrency import get_implementation
from celery.concurrency.solo import TaskPool as SoloPool

from kombu_pgqueue.transport import Transport

logger = logging.getLogger(__name__)

#: apps whose worker had its handoffs turned off here, said in its log once it is ready
#: (worker_init comes before the worker sets up its logging)
_turned_off: weakref.WeakSet[Any] = weakref.WeakSet()


def blocks_its_loop(pool: Any) -> bool:
    """Whether a worker of pool ``pool`` (a class or Celery's name of one) runs its tasks
    in its event loop."""
    found = get_implementation(pool)
    return isinstance(found, type) and issubclass(found, SoloPool)


def _no_handoffs_to_a_blocking_loop(sender: Any = None, **_: Any) -> None:
    worker = sender
    if worker is None or not blocks_its_loop(worker.pool_cls):
        return
    app = worker.app
    options = dict(app.conf.broker_transport_options or {})
    if "handoff" in options:
        return
    with app.connection_for_read() as connection:
        if not isinstance(connection.transport, Transport):
            return
    app.conf.broker_transport_options = {**options, "handoff": False}
    _turned_off.add(app)


def _say_so(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None and app in _turned_off:
        _turned_off.discard(app)
        logger.info(
            "pgqueue: handoffs off for this worker: its pool runs tasks in its event loop, "
            "so a message handed to it would wait for the task that runs; it is woken and "
            "claims instead (the transport option handoff chooses)"
        )


signals.worker_init.connect(
    _no_handoffs_to_a_blocking_loop, weak=False, dispatch_uid="celery_pgqueue.pools"
)
signals.worker_ready.connect(_say_so, weak=False, dispatch_uid="celery_pgqueue.pools.ready")
