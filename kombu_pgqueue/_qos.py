"""What Kombu keeps per delivery, over pgqueue's leases: the prefetch window (QoS) and
the message object, which hand acks, rejects and restores to the consumer."""

from __future__ import annotations

from typing import Any

from kombu.transport import virtual


class QoS(virtual.QoS):
    """Prefetch accounting over leases: acks, rejects and restores go to the consumer."""

    def append(self, message: Any, delivery_tag: str) -> None:
        super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
        self.channel.consumer.settler.hold(delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        self.channel.consumer.settler.ack(delivery_tag)
        super().ack(delivery_tag)  # type: ignore[no-untyped-call]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self.channel.consumer.settler.reject(delivery_tag, requeue)
        self._quick_ack(delivery_tag)

    def forget(self, delivery_tag: str) -> None:
        """Settled by the consumer itself (dead-lettered): no longer held."""
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Hand back every held message at once; they are redelivered immediately."""
        self._flush()  # type: ignore[no-untyped-call]
        tags = list(self._delivered)
        self._delivered.clear()
        self.channel.consumer.settler.restore(tags)
        return []


class Message(virtual.Message):
    """A delivery whose body failed to decode is marked, so that its ack (Celery acks
    such a message to be rid of it) moves it to the dead letters instead."""

    def decode(self) -> Any:
        try:
            return super().decode()  # type: ignore[no-untyped-call]
        except Exception as exc:
            self.channel.consumer.settler.undecodable(self.delivery_tag, exc)
            raise
