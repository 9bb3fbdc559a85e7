"""Exactly-once effects: a task's database writes and its ack commit in one transaction.

.. code-block:: python

    from celery_pgqueue import AtomicTask

    @app.task(bind=True, base=AtomicTask)
    def charge(self, order_id):
        self.db.execute("INSERT INTO charge (order_id) VALUES (%s)", (order_id,))
        receipt.delay(order_id)           # a row of the same transaction

While the body runs, ``self.db`` is a psycopg connection to the broker's database with a
transaction open. When the body returns, the delivery's message row is deleted in that
transaction, fenced by the delivery's lease, and the transaction commits: the writes and
the ack are one commit. A worker killed before it leaves nothing, and the message runs
again; one killed after it leaves the message acked. If the fenced delete finds no row
(the lease was lost: it ended, and another delivery holds the message), the transaction
rolls back, the writes vanish, and the delivery that holds the message runs it. If the
body raises, the transaction rolls back and Celery handles the message as it would
(failure, ``Reject``, ``acks_late``). What the body publishes (``delay()``,
``apply_async()``, ``self.retry()``, ``self.replace()``) and the links and chain that
Celery sends on success go into the same transaction.

``self.retry()`` rolls back what the body wrote before it, and the retry message and the
ack of this delivery then commit together: a retry exists exactly when the attempt that
asked for it ended. ``Ignore`` (and ``self.replace()``, which raises it) commits.

``atomic_db`` chooses where ``self.db`` comes from: :class:`Psycopg` (the default),
:class:`SQLAlchemy` (a ``Session`` from a sessionmaker, or a ``Connection`` from an
``Engine``) or :class:`Django` (Django's connection inside ``transaction.atomic()``). The
database must be the broker's; another raises :class:`~kombu_pgqueue.ConfigurationError`
at the first attempt. See docs/atomic.md.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import psycopg
from celery import Task, signals
from celery.canvas import group, maybe_signature
from celery.exceptions import Ignore, Reject, Retry
from celery.worker.request import Request

from kombu_pgqueue import atomic, transactions
from kombu_pgqueue.atomic import (
    Delivery,
    Django,
    Fence,
    Psycopg,
    SQLAlchemy,
    Transaction,
    TransactionSource,
)
from kombu_pgqueue.exceptions import ConfigurationError, PgQueueError

logger = logging.getLogger(__name__)

__all__ = [
    "AtomicTask",
    "Django",
    "LeaseLost",
    "Psycopg",
    "SQLAlchemy",
    "Transaction",
    "TransactionSource",
]


class LeaseLost(PgQueueError):
    """The attempt could not ack its delivery: its lease was lost. It was rolled back."""


# -- the task ------------------------------------------------------------------------------

#: the attempt running in this thread (or asyncio task)
_current: ContextVar[_Attempt | None] = ContextVar("pgqueue_atomic_attempt", default=None)
#: (conninfo, schema) -> its Fence, shared by every atomic task of the process
_fences: dict[tuple[str, str], Fence] = {}


class AtomicRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """The worker's request of an atomic task. In the process that consumes (prefork's
    main process, whose pool child committed the ack with the work), a success says the
    ack is done: the worker's own ack then sends nothing.

    Celery builds a subclass of the task's Request per task type
    (``celery.worker.request.create_request_cls``) with an ``on_success`` of its own,
    which calls ``acknowledge()``; that one is wrapped here as it is made.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "on_success" in cls.__dict__:
            cls.on_success = _noting_success(cls.__dict__["on_success"])

    @staticmethod
    def succeeded(request: Any, failed__retval__runtime: tuple[Any, ...]) -> None:
        """A success of the attempt came back: it committed its ack (an attempt whose
        commit failed raises, and comes back failed)."""
        if not failed__retval__runtime[0]:
            atomic.committed(str(request.message.delivery_tag))


def _noting_success(on_success: Any) -> Any:
    def noting(self: Any, failed__retval__runtime: tuple[Any, ...], **kwargs: Any) -> Any:
        AtomicRequest.succeeded(self, failed__retval__runtime)
        return on_success(self, failed__retval__runtime, **kwargs)

    return noting


AtomicRequest.on_success = _noting_success(Request.on_success)


class AtomicTask(Task):  # type: ignore[misc]  # Celery is untyped
    """A task whose database writes and ack commit together (see the module's docstring).

    ``acks_late`` and ``reject_on_worker_lost`` are on: the message must stay in the
    queue until the transaction that acks it commits, and an attempt whose process died
    committed nothing (or committed its ack: then the requeue finds no row).
    """

    acks_late = True
    reject_on_worker_lost = True
    Request = AtomicRequest
    #: where ``self.db`` comes from: Psycopg() (the default), SQLAlchemy(...), Django(...)
    atomic_db: TransactionSource = Psycopg()

    @property
    def db(self) -> Any:
        """The connection (or Session) of the running attempt's transaction."""
        attempt = _current.get()
        if attempt is None:
            raise RuntimeError(
                f"{self.name}: self.db exists while the task runs in a worker, apply() or "
                "an eager call, not when its function is called directly"
            )
        return attempt.transaction.handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request_stack.top is None:  # called as a function: Celery's own call
            return super().__call__(*args, **kwargs)
        if _current.get() is not None:  # run eagerly inside an attempt: it joins it
            return self.run(*args, **kwargs)
        return _Attempt(self).run(args, kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry()``, after rolling back what the body wrote: the retry message
        and the ack of this delivery commit together, with nothing else."""
        attempt = _current.get()
        if attempt is not None and attempt.task is self and not self.request.called_directly:
            attempt.restart()
        return super().retry(*args, **kwargs)

    def pgqueue_fence(self) -> Fence:
        """The broker side of this task's acks (the app's broker and schema)."""
        fence: Fence | None = self.__dict__.get("_pgqueue_fence")
        if fence is None:
            with self.app.connection_for_write() as connection:
                found = Fence.from_connection(connection)
            fence = _fences.setdefault((found.conninfo, found.schema), found)
            self.__dict__["_pgqueue_fence"] = fence
        return fence


class _Attempt:
    """One run of an atomic task's body, in one transaction, and how it ends."""

    def __init__(self, task: AtomicTask) -> None:
        self.task = task
        self.fence = task.pgqueue_fence()
        self.delivery = _delivery(task)
        self.database = task.atomic_db
        #: the block that makes the attempt's publishes the transaction's, while open
        self._publishing: AbstractContextManager[Any] | None = None
        self.transaction = self._begin()

    def _begin(self) -> Transaction:
        transaction = self.database.begin(self.fence)
        try:
            self.enlisted = self.fence.enlist(
                transaction.handle,
                check=self.database.checks,
                source=f"task {self.task.name}'s atomic_db ({type(self.database).__name__})",
            )
            publishing = transactions.transaction(self.enlisted)
            publishing.__enter__()
            self._publishing = publishing
        except BaseException:
            transaction.close()
            raise
        return transaction

    def _end(self) -> None:
        if self._publishing is not None:
            self._publishing.__exit__(None, None, None)
            self._publishing = None
        try:
            self.transaction.close()
        except Exception as exc:  # a dead connection: the server ended the transaction
            logger.debug("pgqueue: could not close %s's transaction: %r", self.task.name, exc)

    def restart(self) -> None:
        """Roll back and open a new transaction (a retry is sent in it)."""
        self._end()
        self.transaction = self._begin()

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        token = _current.set(self)
        try:
            try:
                retval = self.task.run(*args, **kwargs)
                _send_follow_ups(self.task, retval)
            except (Retry, Ignore):
                self.commit()
                raise
            except BaseException as exc:
                # before Celery records the failure: its errbacks are sent outside
                self._end()
                if self.delivery is not None and _connection_error(exc):
                    raise self._again(f"its database connection failed ({exc!r})") from exc
                raise
            self.commit()
            return retval
        finally:
            _current.reset(token)
            self._end()

    def commit(self) -> None:
        """Ack the delivery in the transaction and commit.

        A lost lease, or a connection that failed (the commit may not have happened),
        raises Reject(requeue=True): the requeue is fenced too, so it puts back only a
        message that is still this delivery's, and the attempt runs again.
        """
        delivery = self.delivery
        try:
            if delivery is None:
                self.transaction.commit()
            elif not self.fence.settle(self.transaction, self.enlisted, delivery):
                where = self.fence.holder(self.enlisted, delivery)
                self._end()
                raise Reject(
                    LeaseLost(
                        f"pgqueue: the lease of message {delivery.message_id} was lost "
                        f"before this attempt committed ({where}): its transaction was "
                        "rolled back and its effects are gone; the delivery that holds the "
                        "message runs it"
                    ),
                    requeue=True,
                )
        except Reject:
            raise
        except Exception as exc:
            if delivery is None or not _connection_error(exc):
                raise
            raise self._again(f"its ack or commit failed ({exc!r})") from exc
        if delivery is not None:
            atomic.committed(delivery.tag)

    def _again(self, why: str) -> Reject:
        message_id = self.delivery.message_id if self.delivery is not None else None
        return Reject(
            f"pgqueue: an attempt of message {message_id} failed to commit: {why}. Its "
            "effects are gone and the message goes back to the queue, unless the commit "
            "did happen: then both are done",
            requeue=True,
        )


def _delivery(task: AtomicTask) -> Delivery | None:
    """The delivery the attempt acks; None when there is none (apply(), eager calls)."""
    request = task.request
    if request.is_eager:
        return None
    delivery = Delivery.from_properties(request.properties)
    if delivery is None:
        raise ConfigurationError(
            f"{task.name} is an AtomicTask, but its message was not delivered by a pgqueue "
            "broker: there is no lease to ack it with in the task's transaction"
        )
    if not task.acks_late:
        raise ConfigurationError(
            f"{task.name} is an AtomicTask with acks_late off: the worker acked its message "
            "before it ran, so no transaction can ack it with the task's work. Leave "
            "acks_late on"
        )
    return delivery


def _connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or the driver error a SQLAlchemy or Django error wraps) says the
    connection failed or the transaction was rolled back by the server (a serialization
    failure, a deadlock): the outcome of a commit is then unknown or void."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (psycopg.OperationalError, psycopg.InterfaceError)):
            return True
        seen = getattr(seen, "orig", None) or seen.__cause__
    return False


def _send_follow_ups(task: AtomicTask, retval: Any) -> None:
    """Send the links and the rest of the chain now, in the transaction, and leave none
    for Celery's tracer, which would send them after the commit (celery/app/trace.py,
    ``_dispatch_callbacks_and_chain``, does the same with the same options)."""
    request = task.request
    callbacks, chain = request.callbacks, request.chain
    if not callbacks and not chain:
        return
    app = task.app
    inherit = app.conf.task_inherit_parent_priority
    options: dict[str, Any] = {
        "parent_id": request.id,
        "root_id": request.root_id or request.id,
        "priority": (request.delivery_info or {}).get("priority") if inherit else None,
    }
    if callbacks:
        signatures = [maybe_signature(sig, app=app) for sig in callbacks]
        if len(signatures) == 1:
            signatures[0].apply_async((retval,), **options)
        else:
            plain = [sig for sig in signatures if not isinstance(sig, group)]
            for sig in signatures:
                if isinstance(sig, group):
                    sig.apply_async((retval,), **options)
            if plain:
                group(plain, app=app).apply_async((retval,), **options)
    if chain:
        following = maybe_signature(chain[-1], app=app)
        following.apply_async((retval,), chain=chain[:-1], **options)
    request.callbacks = None
    request.chain = None


def _expect_atomic_ack(sender: Any = None, request: Any = None, **_: Any) -> None:
    """In the consuming process, as the worker receives a task: an atomic task's
    delivery is acked by its transaction, so the worker's own ack may find no row."""
    if request is not None and isinstance(request.task, AtomicTask):
        atomic.expect(str(request.message.delivery_tag))


signals.task_received.connect(_expect_atomic_ack, weak=False)
