"""A publishing process, as a web server with threads is: ``python publisher_proc.py URL
SCHEMA THREADS EACH [OPTION=VALUE ...]`` publishes EACH messages to queue "fleet" from
each of THREADS threads at once, prints "published", then waits for a line on stdin and
exits."""

from __future__ import annotations

import sys
import threading

from fleet_app import _value
from kombu import Connection, Producer, Queue

import kombu_pgqueue  # noqa: F401 - registers pgqueue://


def main() -> None:
    url, schema, threads, each = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    options = {"schema": schema}
    options.update({k: _value(v) for k, v in (a.split("=", 1) for a in sys.argv[5:])})
    conn = Connection(url, transport_options=options)
    Queue("fleet", channel=conn.default_channel).declare()
    start = threading.Barrier(threads)

    def publish() -> None:
        # each thread its own Kombu connection, as Celery's producer pool gives threads
        with Connection(url, transport_options=options) as mine:
            producer = Producer(mine)
            start.wait()
            for i in range(each):
                producer.publish({"i": i}, routing_key="fleet")

    workers = [threading.Thread(target=publish) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    print("published", flush=True)
    sys.stdin.readline()
    conn.release()


if __name__ == "__main__":
    main()
