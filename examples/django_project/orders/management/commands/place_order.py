from django.core.management.base import BaseCommand

from orders.services import place_order


class Command(BaseCommand):
    help = "Create an order and enqueue its shipping in the same transaction."

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("item")

    def handle(self, *args, item: str, **options):  # type: ignore[no-untyped-def]
        order = place_order(item)
        self.stdout.write(f"order {order.pk} placed; its shipping task goes out with it")
