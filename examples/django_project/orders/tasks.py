from celery import shared_task

from .models import Order, Shipment


@shared_task
def ship_order(order_id: int) -> None:
    """Ship the order, and record whether it was there (committed) when the task ran."""
    found = Order.objects.filter(pk=order_id).update(status="shipped")
    Shipment.objects.create(order_id=order_id, found_order=bool(found))
