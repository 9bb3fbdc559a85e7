"""Transactional enqueue from asyncio code, through SQLAlchemy's ``run_sync``.

.. code-block:: python

    from celery_pgqueue.asyncio import enqueue

    async with AsyncSession(engine) as session, session.begin():
        session.add(Order(id=42))
        [result] = await enqueue(session, ship_order.s(42))
    # committed: the order and the task together; rolled back: neither

``session`` is a SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` on the
``postgresql+psycopg`` (psycopg 3 async) driver, inside a transaction. The task
row is inserted by that transaction, so the guarantees are those of
:func:`kombu_pgqueue.transaction`: visible (and NOTIFY sent) at commit, gone on
rollback or if the process dies first, savepoints (``begin_nested()``) as for any
row. A broker in another database raises :class:`~kombu_pgqueue.ConfigurationError`.

How, and what it costs: Kombu and Celery publish synchronously, so the publish
runs in ``await session.run_sync(...)``. SQLAlchemy calls it in a greenlet in
which the synchronous ``Session`` facade works: each statement it sends is
awaited on the async driver, and the event loop serves other coroutines while the
``INSERT`` travels. The rest of the publish is synchronous code on the loop's
thread: building and serialising the message (CPU), and the broker's own
connections for what is not a publish, chiefly Celery declaring a queue the first
time a process publishes to it (one round trip on the broker's pool, then cached).
A ``task.delay()`` called straight from a coroutine is not enlisted, even inside
``session.begin()``: it publishes through the broker's pool and blocks the loop
for that round trip, as with any Kombu transport.

Handing an ``AsyncSession`` to ``kombu_pgqueue.transaction()`` directly raises
``ConfigurationError``: a synchronous publish cannot wait for the async driver on
the loop it is blocking, and only SQLAlchemy's greenlet (``run_sync``) bridges the two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kombu_pgqueue.transactions import transaction

__all__ = ["enqueue", "run_enlisted"]

T = TypeVar("T")


async def run_enlisted(session: Any, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Await ``fn(*args, **kwargs)`` with its pgqueue publishes in ``session``'s transaction.

    ``fn`` is synchronous: a Kombu ``producer.publish``, ``send_many``, a function
    calling ``task.delay`` several times. It runs inside ``session.run_sync``.
    """
    if not hasattr(session, "run_sync"):
        raise TypeError(
            f"run_enlisted() takes a SQLAlchemy AsyncSession or AsyncConnection, not "
            f"{type(session).__name__}; use kombu_pgqueue.transaction() with a synchronous one"
        )

    def call(sync_session: Any) -> T:
        with transaction(sync_session):
            return fn(*args, **kwargs)

    result: T = await session.run_sync(call)
    return result


async def enqueue(session: Any, *signatures: Any) -> list[Any]:
    """Publish Celery signatures in ``session``'s transaction; return their AsyncResults.

    Options go on the signature: ``task.s(42).set(countdown=60, queue="io")``.
    """
    return await run_enlisted(session, _apply_all, signatures)


def _apply_all(signatures: tuple[Any, ...]) -> list[Any]:
    return [signature.apply_async() for signature in signatures]
