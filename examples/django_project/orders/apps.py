from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "orders"

    def ready(self) -> None:
        import celery_pgqueue.django

        # every task published inside atomic() is a row of that transaction
        celery_pgqueue.django.enlist_atomic()
