"""What a worker on pgqueue sets up as it starts (signal ``worker_init``).

* **The broker's schema first.** Celery creates its result tables as the worker starts
  (``database_create_tables_at_setup``), before the broker's first connection would
  install the broker's schema; result tables placed in that schema
  (``database_table_schemas``, docs/configuration.md) then had no schema to go to, and
  the worker died at startup. The schema is installed or upgraded here first, as the
  broker's first connection would (unless ``auto_migrate`` is off); a database that
  cannot be reached yet is left to the worker's own retries.
* **Result tables on first use.** Celery's database result backend creates its tables
  as it is made (``database_create_tables_at_setup``), and a worker makes it while it
  prints its banner: a database not up yet ended the worker after three tries, where the
  broker's connection waits ("Trying again in 2.00 seconds... (1/100)"). A worker on
  pgqueue creates them on first use instead (Celery's creation there is safe when
  processes race), so it waits for its database however its results are configured;
  :func:`configure` sets the same for every process. An app that sets the setting
  itself keeps its choice.
* **A sweep of what is kept.** A thread of the worker's main process trims the failed
  tasks kept in the dead letters (:func:`celery_pgqueue.archive.trim`) and deletes the
  results older than Celery's ``result_expires`` (:func:`expire_results`; Celery's
  database backend leaves that to ``celery beat``'s ``celery.backend_cleanup``, and
  without beat its table only grew) as the worker starts, then every
  ``pgqueue_sweep_interval`` seconds (default 3600). The worker says once in its log
  what it keeps and for how long. Several workers sweep the same rows harmlessly: a
  delete is a delete.
* **A broker URL Kombu cannot use, said in one line.** ``broker_url =
  "postgresql://..."`` (Kombu has no such transport) ended a worker in Kombu's bare
  ``KeyError: 'No such transport: postgresql'``; a ``celeryd_init`` receiver, which runs
  before Celery resolves the transport, logs what to write instead
  (:func:`transport_hint`), then Celery fails as before.
* **No handoffs to a loop that runs tasks.** Celery's solo pool runs each task inside
  the worker's event loop: while a task runs, the worker reads nothing. A message
  handed off to it then (docs/lifecycle.md, "Handoff") would wait behind that task
  while other workers idle, so a solo worker takes no handoffs (transport option
  ``handoff`` False): it is woken, and claims, once its loop is back, like any
  consumer, and publishes hand messages to workers of other pools. An app that sets
  ``handoff`` itself keeps its choice.

A process that publishes before any worker ran (a web app) creates Celery's result tables
as its backend is made, at its first ``delay()``, also before its broker's first
statement: :func:`configure` sets ``database_engine_callback`` to :class:`SchemaFirst`,
which installs the broker's schema as the backend's first engine is made.

Every ``celery`` command imports this package (its ``celery pgqueue`` command is an
entry point), so the receivers are connected in every worker started from the command
line; a worker started from Python connects them by importing ``celery_pgqueue``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import datetime, timedelta
from typing import Any

import psycopg
from celery import bootsteps, signals
from celery.concurrency import ALIASES
from celery.concurrency.solo import TaskPool as SoloPool
from kombu.utils.imports import symbol_by_name
from kombu.utils.url import maybe_sanitize_url

from kombu_pgqueue.admin import Broker, missing_transport
from kombu_pgqueue.exceptions import ConfigurationError, PgQueueError

from . import archive

logger = logging.getLogger(__name__)

#: apps whose worker had its handoffs turned off here, said in its log once it is ready
#: (worker_init comes before the worker sets up its logging)
_turned_off: weakref.WeakSet[Any] = weakref.WeakSet()


def blocks_its_loop(pool: Any) -> bool:
    """Whether a worker of pool ``pool`` (a class or Celery's name of one) runs its tasks
    in its event loop. A name is not imported: Celery imports the pool's module after
    worker_init, so that a handler there may monkey-patch first (gevent, eventlet)."""
    if isinstance(pool, str):  # an alias, or a path (module:Class or module.Class)
        path = str(ALIASES.get(pool, pool)).replace(":", ".")
        return path == str(ALIASES["solo"]).replace(":", ".")
    return isinstance(pool, type) and issubclass(pool, SoloPool)


def transport_hint(app: Any) -> str | None:
    """One line saying what to do when Kombu has no transport for ``app``'s broker URL
    and pgqueue can tell why (a PostgreSQL URL, or ``pgqueue://`` in a process that did
    not import kombu_pgqueue); None otherwise. The password is masked."""
    url = str(app.conf.broker_url or "")
    try:
        app.connection_for_read().get_transport_cls()
    except KeyError:
        pass  # Kombu knows no transport of that name
    except Exception:
        return None  # a transport that is there, and fails in its own words
    else:
        return None
    scheme, _, rest = url.partition("://")
    hint = missing_transport(scheme, maybe_sanitize_url(f"pgqueue://{rest}"))
    return None if hint is None else f"broker_url {maybe_sanitize_url(url)!r}: {hint}"


def _before_init(sender: Any = None, instance: Any = None, **_: Any) -> None:
    app = getattr(instance, "app", None)
    hint = None if app is None else transport_hint(app)
    if hint is not None:
        # logging is not set up yet: Python's last-resort handler prints it on stderr
        logger.error("pgqueue: %s", hint)


def _starting(sender: Any = None, **_: Any) -> None:
    worker = sender
    if worker is None:
        return
    app = worker.app
    broker = _broker(app)
    if broker is None:
        return
    _schema_first(app, broker)
    tables_on_first_use(app.conf)
    _no_handoffs_to_a_blocking_loop(app, worker.pool_cls)
    app.steps["worker"].add(Sweep)  # the blueprint is made after worker_init


def _broker(app: Any) -> Broker | None:
    """``app``'s pgqueue broker; None for another transport, or options that its own
    connection will report as wrong (as it always did)."""
    with app.connection_for_read() as connection:
        if getattr(connection.get_transport_cls(), "driver_type", None) != "pgqueue":
            return None
        try:
            return Broker.from_connection(connection)
        except ConfigurationError:
            return None


#: Celery's setting (5.5+) that creates the result tables as the backend is made
TABLES_AT_SETUP = "database_create_tables_at_setup"


def tables_on_first_use(conf: Any) -> None:
    """Celery's database result backend creates its tables on first use, not as it is
    made, unless the app set that itself (see the module)."""
    if not conf.value_set_for(TABLES_AT_SETUP):
        conf[TABLES_AT_SETUP] = False


def _schema_first(app: Any, broker: Broker) -> bool:
    """Install the broker's schema if Celery's result tables go there; False when the
    database could not be reached (worth another try), True otherwise."""
    tables = app.conf.database_table_schemas or {}
    if broker.schema not in tables.values() or not broker.options.auto_migrate:
        return True
    try:
        broker.ensure_schema()
    except (psycopg.Error, PgQueueError) as exc:
        # not reachable yet, or not this role's to install: the worker's own connection
        # retries and errors say what is wrong
        logger.debug("pgqueue: could not install schema %r before startup: %r", broker.schema, exc)
        return not isinstance(exc, psycopg.OperationalError)
    return True


class SchemaFirst:
    """Celery's ``database_engine_callback``: before the result backend's first engine
    creates its tables, install the broker's schema if they go there (once a process),
    then call the callback the app had (``previous``)."""

    def __init__(self, app: Any, previous: Any = None) -> None:
        self.app = app
        self.previous = previous
        self.done = False

    def __repr__(self) -> str:
        return f"<celery_pgqueue SchemaFirst, then {self.previous!r}>"

    def __call__(self, engine: Any) -> None:
        if not self.done:
            broker = _broker(self.app)
            # a database not reachable yet: the next engine (Celery's retry) tries again
            self.done = broker is None or _schema_first(self.app, broker)
        previous = self.previous
        if isinstance(previous, str):
            previous = self.previous = symbol_by_name(previous)
        if previous is not None:
            previous(engine)


#: the Celery setting: seconds between two sweeps of a worker
SWEEP_INTERVAL = "pgqueue_sweep_interval"
DEFAULT_SWEEP_INTERVAL = 3600.0
#: seconds until a sweep that failed is tried again
SWEEP_RETRY = 30.0


def sweep(app: Any, *, now: datetime | None = None) -> int:
    """One sweep of what ``app`` keeps, as of ``now`` (None: each store's clock): the
    failed tasks' letters and the results kept too long. Returns how many rows it
    deleted."""
    return archive.trim(app, now=now) + expire_results(app, now=now)


def _database_backend(app: Any) -> Any:
    """``app``'s result backend if it is Celery's database backend, else None."""
    try:
        from celery.backends.database import DatabaseBackend
    except ImportError:  # no SQLAlchemy: no database backend either
        return None
    backend = app.backend
    return backend if isinstance(backend, DatabaseBackend) else None


def expire_results(app: Any, *, now: datetime | None = None) -> int:
    """Delete the task and group results of Celery's database backend older than
    ``result_expires`` as of ``now`` (None: Celery's clock, ``app.now()``), as
    ``celery.backend_cleanup`` does; return how many. Nothing for another backend, or
    with ``result_expires`` None (kept for ever)."""
    backend = _database_backend(app)
    if backend is None or not backend.expires:
        return 0
    from celery.backends.database import session_cleanup

    cutoff = (now or app.now()) - backend.expires
    session = backend.ResultSession()
    with session_cleanup(session):
        deleted = 0
        for model in (backend.task_cls, backend.taskset_cls):
            deleted += int(session.query(model).filter(model.date_done < cutoff).delete())
        session.commit()
    return deleted


def _duration(span: timedelta) -> str:
    """``7 days``, ``12 hours``, ``90 seconds``: the largest unit that divides it."""
    seconds = span.total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds:g} seconds"


def kept(app: Any) -> str:
    """What the worker's log says it keeps (see the module)."""
    conf = app.conf
    if not conf.get(archive.SETTING):
        said = "pgqueue: tasks that fail for good are not kept (setting pgqueue_keep_failed)"
    else:
        kept_for = archive.retention(conf)
        span = "for ever" if kept_for is None else f"for {_duration(kept_for)}"
        said = (
            f"pgqueue: tasks that fail for good are kept as dead letters {span} "
            "(celery pgqueue dead list --reason failed; settings pgqueue_keep_failed, "
            "pgqueue_keep_failed_for)"
        )
    backend = _database_backend(app)
    if backend is not None:
        expires = backend.expires
        span = f"after {_duration(expires)}" if expires else "never (result_expires None)"
        said += f"; results expire {span} (result_expires)"
    return said


class Sweep(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """The worker's sweep (see the module): a daemon thread, from the worker's start to
    its stop. ``stopping`` is set by :meth:`stop` only; the thread only reads it."""

    label = "pgqueue sweep"
    # after the pool's start, which forks prefork's children: a child forked while this
    # thread imports (its first sweep loads the result backend's SQLAlchemy dialect)
    # inherits that import's lock, held by a thread it does not have, and hangs at its
    # first result (seen: tests/atomic, a child stuck in sqlalchemy.dialects' import)
    requires = ("celery.worker.components:Pool",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, parent: Any) -> None:
        app = parent.app
        logger.info("%s", kept(app))
        interval = float(app.conf.get(SWEEP_INTERVAL) or DEFAULT_SWEEP_INTERVAL)
        self.thread = threading.Thread(
            target=self._run, args=(app, interval), name="pgqueue-sweep", daemon=True
        )
        self.thread.start()

    def stop(self, parent: Any) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def terminate(self, parent: Any) -> None:
        """A cold shutdown (StartStopStep's would stop only a ``create()``'d object)."""
        self.stop(parent)

    def _run(self, app: Any, interval: float) -> None:
        wait = interval
        while not self.stopping.is_set():
            try:
                swept = sweep(app)
            except Exception as exc:
                # the database not reachable yet (a worker started before it), or a
                # setting refused: tried again soon, not a whole interval later
                wait = min(interval, SWEEP_RETRY)
                logger.warning("pgqueue: sweep failed, will try again in %gs: %r", wait, exc)
            else:
                wait = interval
                if swept:
                    logger.info("pgqueue: sweep deleted %d rows kept too long", swept)
            self.stopping.wait(wait)


def _no_handoffs_to_a_blocking_loop(app: Any, pool: Any) -> None:
    options = dict(app.conf.broker_transport_options or {})
    if "handoff" in options or not blocks_its_loop(pool):
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


signals.celeryd_init.connect(_before_init, weak=False, dispatch_uid="celery_pgqueue.url")
signals.worker_init.connect(_starting, weak=False, dispatch_uid="celery_pgqueue.worker")
signals.worker_ready.connect(_say_so, weak=False, dispatch_uid="celery_pgqueue.worker.ready")
