"""A failover list (``broker_url = "url1;url2"``) whose first server is down: the
publish reaches the second. Kombu keeps the port of the URL it leaves when it switches
to a URL that gives none, so the list's URLs must agree on giving a port: the
transport refuses a list that mixes them (tests/transport/test_bad_inputs.py), and the
pytest plugin's URL writes its port out, as pytest-celery's failover test needs."""

from __future__ import annotations

import psycopg
from celery import Celery
from clusters import Cluster
from psycopg import sql

from kombu_pgqueue.embedded import broker_url


def test_a_list_of_a_dead_server_and_the_plugins_url_publishes_to_the_live_one(
    pgqueue_broker_url: str, pgqueue_dsn: str, pgqueue_schema: str
) -> None:
    with Cluster.primary() as dead:
        first = broker_url(dead.dsn)
        dead.stop("immediate")
        app = Celery("failover_list", broker=f"{first};{pgqueue_broker_url}")
        app.conf.broker_transport_options = {"schema": pgqueue_schema}
        app.send_task("anything", args=(1,), retry_policy={"max_retries": 3})

    with psycopg.connect(pgqueue_dsn) as conn:
        query = sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(pgqueue_schema, "message_store")
        )
        assert conn.execute(query).fetchone() == (1,)
