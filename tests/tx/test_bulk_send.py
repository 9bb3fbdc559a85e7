"""celery_pgqueue.bulk.send_many: many task messages by COPY, run by a real worker.

Executions are recorded by the tasks themselves (id, args, kwargs, queue, eta), so
each test checks what the worker actually received, not what was meant to be sent.
"""

from __future__ import annotations

import copy
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import celery.contrib.testing.tasks  # noqa: F401 - registers celery.ping
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery_apps import celery_app
from kombu.utils.json import loads
from waiting import wait_for

import kombu_pgqueue
from celery_pgqueue.bulk import send_many
from celery_pgqueue.messages import TaskMessageFactory, task_message
from kombu_pgqueue import codec


class Ran:
    """What the worker executed, in order."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self.lock:
            self.calls.append(
                {
                    "id": request.id,
                    "args": list(args),
                    "kwargs": kwargs,
                    "queue": request.delivery_info.get("routing_key"),
                    "priority": request.delivery_info.get("priority"),
                    "eta": request.eta,
                    "at": time.time(),
                }
            )

    def labels(self) -> list[Any]:
        return [call["args"][0] for call in self.calls]


def _record_task(app: Celery, name: str = "bk.record") -> tuple[Any, Ran]:
    ran = Ran()

    @app.task(name=name, shared=False, bind=True)
    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        ran.add(self.request, args, kwargs)

    return record, ran


@pytest.fixture
def record(app: Celery, connection: Any) -> tuple[Any, Ran]:
    return _record_task(app)


def test_send_many_runs_every_signature_with_its_args(app, record, rows):
    task, ran = record
    sigs = [task.s(i, tag=f"t{i}") for i in range(15)]
    sigs += [task.s(nested={"a": [1, 2.5, None], "b": "é"}), task.s("only-args", 2)]
    report = send_many(app, sigs, batch_size=4)
    assert (report.enqueued, report.skipped) == (17, 0)
    assert len(set(report.task_ids)) == 17
    assert report.task_ids == [sig.options["task_id"] for sig in sigs]
    assert len(rows()) == 17
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        wait_for(lambda: len(ran.calls) >= 17, 30, "all 17 tasks to run")
    got = {call["id"]: (call["args"], call["kwargs"]) for call in ran.calls}
    expected = {
        task_id: (list(sig.args), sig.kwargs)
        for task_id, sig in zip(report.task_ids, sigs, strict=True)
    }
    assert got == expected
    assert len(ran.calls) == 17


def test_send_many_honours_countdown_and_eta(app, record, rows, db, schema):
    task, ran = record
    eta = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    sent_at = time.time()
    report = send_many(
        app,
        [
            task.s("eta").set(eta=eta),
            task.s("countdown").set(countdown=1),
            task.s("far").set(countdown=600),
            task.s("now"),
        ],
    )
    assert report.enqueued == 4
    delays = {
        headers["argsrepr"]: (delayed, round(float(due)))
        for headers, delayed, due in rows(
            "headers, delayed, extract(EPOCH FROM next_iteration - now())"
        )
    }
    assert delays["('far',)"] == (True, 600)
    assert delays["('eta',)"][0] is True
    assert delays["('countdown',)"][0] is True
    assert delays["('now',)"][0] is False
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        wait_for(lambda: len(ran.calls) >= 3, 20, "the due tasks to run")
    by_label = {call["args"][0]: call for call in ran.calls}
    assert sorted(by_label) == ["countdown", "eta", "now"]
    assert by_label["eta"]["at"] >= eta.timestamp() - 0.05
    assert datetime.fromisoformat(by_label["eta"]["eta"]) == eta
    assert by_label["countdown"]["at"] >= sent_at + 1 - 0.05
    assert rows("delayed") == [(True,)]  # "far" still waits in the table


def test_send_many_honours_priority(app, record, rows):
    task, ran = record
    app.conf.worker_prefetch_multiplier = 1
    report = send_many(
        app,
        [
            task.s("low").set(priority=1),
            task.s("high").set(priority=9),
            task.s("mid").set(priority=5),
            task.s("default"),
        ],
    )
    assert report.enqueued == 4
    stored = {
        h["argsrepr"]: (p, props["priority"])
        for h, p, props in rows("headers, priority, properties")
    }
    assert stored == {
        "('low',)": (1, 1),
        "('high',)": (9, 9),
        "('mid',)": (5, 5),
        "('default',)": (0, 0),
    }
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False):
        wait_for(lambda: len(ran.calls) >= 4, 20, "the four tasks to run")
    assert ran.labels() == ["high", "mid", "low", "default"]
    assert [call["priority"] for call in ran.calls] == [9, 5, 1, 0]


def test_send_many_honours_queue_routing(app, connection, rows):
    app.conf.task_routes = {"bk.routed": {"queue": "routed"}}
    task, ran = _record_task(app)
    routed, routed_ran = _record_task(app, "bk.routed")
    report = send_many(
        app, [task.s("to-other").set(queue="other"), routed.s("by-route"), task.s("default")]
    )
    assert report.enqueued == 3
    assert sorted(rows("queue")) == [("celery",), ("other",), ("routed",)]
    with start_worker(
        app, pool="threads", perform_ping_check=False, queues=["celery", "other", "routed"]
    ):
        wait_for(lambda: len(ran.calls) + len(routed_ran.calls) >= 3, 20, "the three tasks")
    queues = {call["args"][0]: call["queue"] for call in ran.calls + routed_ran.calls}
    assert queues == {"to-other": "other", "by-route": "routed", "default": "celery"}


def test_send_many_again_with_same_task_ids_skips_all(app, record, rows):
    task, ran = record
    sigs = [task.s(i) for i in range(6)]
    first = send_many(app, sigs)
    assert (first.enqueued, first.skipped) == (6, 0)
    # the same signatures (their task ids were set by the first call) ...
    again = send_many(app, sigs)
    assert (again.enqueued, again.skipped) == (0, 6)
    assert again.task_ids == first.task_ids
    # ... and fresh signatures with those ids
    fresh = send_many(app, [task.s(i).set(task_id=t) for i, t in enumerate(first.task_ids)])
    assert (fresh.enqueued, fresh.skipped) == (0, 6)
    assert len(rows()) == 6
    # apply_async with one of them is a send Celery means (as Task.replace's): queued
    task.apply_async((0,), task_id=first.task_ids[0])
    assert len(rows()) == 7
    with start_worker(app, pool="threads", perform_ping_check=False):
        wait_for(lambda: len(ran.calls) >= 7, 20, "the seven tasks")
        wait_for(lambda: rows() == [], 10, "the acks")
        # run and acked: the ids are free again
        assert send_many(app, sigs).enqueued == 6
        wait_for(lambda: len(ran.calls) >= 13, 20, "the six tasks sent again")
    assert sorted(call["args"][0] for call in ran.calls) == sorted([0, *range(6), *range(6)])


def test_send_many_explicit_dedup_key(app, record, rows):
    task, ran = record
    report = send_many(
        app,
        [
            task.s("a").set(dedup_key="k1"),
            task.s("b").set(dedup_key="k1"),
            task.s("c").set(dedup_key="k2"),
        ],
    )
    assert (report.enqueued, report.skipped) == (2, 1)
    assert len(report.task_ids) == 3
    stored = sorted((key, props["dedup_key"]) for key, props in rows("dedup_key, properties"))
    assert stored == [("k1", "k1"), ("k2", "k2")]
    # the explicit key replaces the task-id key: a new id does not get past it
    assert send_many(app, [task.s("d").set(dedup_key="k2")]).skipped == 1
    with start_worker(app, pool="threads", perform_ping_check=False):
        wait_for(lambda: len(ran.calls) >= 2, 20, "the two kept tasks")
        task.delay("sentinel")
        wait_for(lambda: "sentinel" in ran.labels(), 20, "the sentinel")
    assert sorted(ran.labels()) == ["a", "c", "sentinel"]


def test_send_many_without_dedup_task_ids_stores_duplicates(dsn, schema, connection, rows):
    app = celery_app(dsn, schema, dedup_task_ids=False)
    try:
        task, _ = _record_task(app)
        sigs = [task.s(i) for i in range(3)]
        assert send_many(app, sigs).enqueued == 3
        assert send_many(app, sigs).enqueued == 3
        assert rows("dedup_key") == [(None,)] * 6
    finally:
        app.close()


def test_send_many_does_not_drop_link_callbacks(app, record, rows):
    """apply_async sends a signature's links; send_many must send them or refuse."""
    task, ran = record
    sig = task.s("main")
    sig.link(task.si("callback"))
    try:
        report = send_many(app, [sig])
    except (ValueError, TypeError, NotImplementedError):
        return  # refusing what it cannot send is fine; dropping it silently is not
    assert report.enqueued == 1
    [(body,)] = rows("body")
    callbacks = loads(bytes(body))[2]["callbacks"]
    assert [callback["args"] for callback in callbacks or []] == [["callback"]]
    with start_worker(app, pool="threads", perform_ping_check=False):
        wait_for(lambda: "callback" in ran.labels(), 20, "the link callback")
    assert ran.labels() == ["main", "callback"]


@pytest.mark.parametrize("path", ["copy", "enlisted"])
def test_send_many_keeps_the_signatures_order(path, app, record, rows, app_conn):
    """FIFO within a batch: ids (the claim order) follow the signatures' order."""
    task, _ = record
    sigs = [task.s(i) for i in range(20)] + [task.s(20).set(countdown=60), task.s(21)]
    if path == "copy":
        send_many(app, sigs)
    else:
        with app_conn.transaction(), kombu_pgqueue.transaction(app_conn):
            send_many(app, sigs)
    stored = [headers["id"] for (headers,) in rows("headers")]
    # FIFO among the messages that are ready at once; the delayed one (countdown) is
    # delivered when due, wherever its id falls
    ready = [s.options["task_id"] for s in sigs if "countdown" not in s.options]
    assert [task_id for task_id in stored if task_id in ready] == ready
    assert sorted(stored) == sorted(s.options["task_id"] for s in sigs)


# -- the message itself -------------------------------------------------------------------

_ETA = datetime(2031, 5, 4, 3, 2, 1, 123456, tzinfo=timezone.utc)

CASES = {
    "plain": {"args": (1, "a"), "kwargs": {}},
    "kwargs": {"args": (), "kwargs": {"x": [1, 2], "y": {"z": None}, "s": "é"}},
    "eta": {"args": (3,), "kwargs": {"k": 1}, "eta": _ETA},
    "expires": {"args": (4,), "kwargs": {}, "expires": "in 300 s"},
    "priority-queue": {"args": (5,), "kwargs": {}, "priority": 7, "queue": "other"},
    "dedup-key": {"args": (6,), "kwargs": {}, "dedup_key": "k-6"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_factory_message_equals_task_message(case, app, connection):
    spec = dict(CASES[case])

    @app.task(name="bk.compare", shared=False)
    def compare(*args: Any, **kwargs: Any) -> None:
        pass

    if spec.get("expires") == "in 300 s":
        spec["expires"] = datetime.now(timezone.utc) + timedelta(seconds=300)
    args, kwargs = spec.pop("args"), spec.pop("kwargs")
    queue, priority = spec.pop("queue", None), spec.pop("priority", None)
    task_id = f"id-{case}"

    built = task_message(
        app, "bk.compare", args, kwargs, task_id=task_id, queue=queue, priority=priority, **spec
    )
    factory = TaskMessageFactory(app, "bk.compare", queue=queue, priority=priority)
    got = factory.outgoing(args, kwargs, task_id=task_id, **spec)

    # what is stored for the task_message (apply_async's) path, keyed as bulk sends are
    # (apply_async keys each publish call instead: see tests/tx/test_dedup.py)
    message = codec.stamp(copy.deepcopy(built.message), "", built.queue)
    expected = codec.outgoing(built.queue, message, task_keys="task")

    ignored = {"argsrepr", "kwargsrepr", "origin"}
    got_headers = {k: v for k, v in loads(got.headers).items() if k not in ignored}
    expected_headers = {k: v for k, v in loads(expected.headers).items() if k not in ignored}
    assert got_headers == expected_headers

    got_properties, expected_properties = loads(got.properties), loads(expected.properties)
    # stamped by Kombu at each publish (a fresh uuid) and replaced at delivery
    expected_properties.pop("delivery_tag", None)
    # absent means the same as None: the body is not transfer-encoded
    assert expected_properties.pop("body_encoding", None) is got_properties.pop(
        "body_encoding", None
    )
    if "expires" in spec:
        got_ms = int(got_properties.pop("expiration"))
        expected_ms = int(expected_properties.pop("expiration"))
        assert abs(got_ms - expected_ms) < 2000
        assert expected.expires_at is not None and got.expires_at is not None
        assert abs((got.expires_at - expected.expires_at).total_seconds()) < 2
    assert got_properties == expected_properties

    assert got.body == expected.body
    assert loads(got.body) == [list(args), kwargs, loads(got.body)[2]]
    assert (got.queue, got.priority, got.eta, got.dedup_key) == (
        expected.queue,
        expected.priority,
        expected.eta,
        expected.dedup_key,
    )
    assert (got.content_type, got.content_encoding) == (
        expected.content_type,
        expected.content_encoding,
    )
