"""``manage.py demo``: migrate, start a Celery worker, place orders, check what ran.

Every run of ``ship_order`` leaves a ``Shipment`` row saying whether it found its
order; that is how the checks see what the worker did, and when.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import transaction
from django.test import Client

from orders.models import Order, Shipment
from orders.services import place_order
from orders.tasks import ship_order

PROJECT = Path(__file__).resolve().parents[3]


class PaymentDeclined(Exception):
    pass


def shipment(order_id: int, timeout: float = 60) -> Shipment:
    """Wait for the worker to run ship_order(order_id)."""
    deadline = time.monotonic() + timeout
    while (found := Shipment.objects.filter(order_id=order_id).first()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ship_order({order_id}) did not run in {timeout}s")
        time.sleep(0.1)
    return found


def view_order_is_shipped_after_commit() -> bool:
    response = Client().post("/orders/", {"item": "book"})
    order_id = response.json()["order"]
    # had the task run before the commit, it would not have found the order
    return shipment(order_id).found_order and Order.objects.get(pk=order_id).status == "shipped"


def rollback_drops_order_and_task() -> bool:
    try:
        with transaction.atomic():
            doomed = Order.objects.create(item="lamp")
            ship_order.delay(doomed.pk)
            raise PaymentDeclined
    except PaymentDeclined:
        pass
    shipment(place_order("pen").pk)  # a later task has run; the doomed one never will
    return not Order.objects.filter(pk=doomed.pk).exists() and (
        not Shipment.objects.filter(order_id=doomed.pk).exists()
    )


def nested_rollback_drops_only_its_task() -> bool:
    with transaction.atomic():
        kept = Order.objects.create(item="mug")
        ship_order.delay(kept.pk)
        try:
            with transaction.atomic():  # a savepoint
                gift = Order.objects.create(item="gift wrap")
                ship_order.delay(gift.pk)
                raise PaymentDeclined
        except PaymentDeclined:
            pass
    shipped = shipment(kept.pk).found_order
    shipment(place_order("card").pk)
    return shipped and not Shipment.objects.filter(order_id=gift.pk).exists()


def no_task_ever_missed_its_order() -> bool:
    return not Shipment.objects.filter(found_order=False).exists()


CHECKS: dict[str, Callable[[], bool]] = {
    "POST /orders/: the task runs after the commit and finds its order": (
        view_order_is_shipped_after_commit
    ),
    "atomic() rolled back: no order, and its task never ran": rollback_drops_order_and_task,
    "nested atomic() rolled back: only its task is dropped": nested_rollback_drops_only_its_task,
    "no task ran before its order was committed": no_task_ever_missed_its_order,
}


class Command(BaseCommand):
    help = "Run the transactional-enqueue demo against a real worker."

    def handle(self, *args, **options):  # type: ignore[no-untyped-def]
        call_command("migrate", verbosity=0)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "shop",
                "worker",
                "-l",
                "warning",
                "-c",
                "2",
                "-n",
                f"django-demo-{os.getpid()}@%h",
            ],
            cwd=PROJECT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT), *sys.path])},
        )
        try:
            started = time.monotonic()
            passed = 0
            for name, check in CHECKS.items():
                ok = check()
                passed += ok
                self.stdout.write(f"  {'ok  ' if ok else 'FAIL'} {name}")
            elapsed = time.monotonic() - started
            self.stdout.write(f"{passed}/{len(CHECKS)} checks passed in {elapsed:.1f}s")
        finally:
            worker.send_signal(signal.SIGTERM)  # warm shutdown
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        if passed != len(CHECKS):
            sys.exit(1)
