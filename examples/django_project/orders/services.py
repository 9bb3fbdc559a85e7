from django.db import transaction

from .models import Order
from .tasks import ship_order


def place_order(item: str) -> Order:
    """Create the order and enqueue its shipping in one transaction: both or neither."""
    with transaction.atomic():
        order = Order.objects.create(item=item)
        ship_order.delay(order.pk)  # enlisted: written by this transaction
    return order
