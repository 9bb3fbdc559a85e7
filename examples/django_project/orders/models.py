from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    status = models.CharField(max_length=20, default="new")


class Shipment(models.Model):
    """One row per run of ship_order: what the worker found."""

    order_id = models.BigIntegerField()
    found_order = models.BooleanField()
