"""The host's relay (transport option ``relay``, issue 43): the consumers of a host share
one LISTEN session; each still gets its work at once, a new hub takes over when the
hub's process dies, and 200 idle consumers fit on a server of max_connections 100.

Every consumer here polls once a minute at most (``polling_interval`` 60: the hub's poll;
a client's own, 12 times that): what arrives within the tests' waits came through a
notification, relayed."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import psycopg
import pytest
from clusters import Cluster
from held_sessions import listening as waiting_sessions
from kombu import Connection, Queue
from relay_consumers import Fleet
from waiting import wait_for

from kombu_pgqueue import embedded

RELAYED = {"relay": True, "polling_interval": 60, "pool_max_idle": 0.5}


def _own(index: int) -> list[str]:
    return [f"own.{index}", "shared"]


@pytest.fixture
def fleet(broker_base_url: str, schema: str) -> Iterator[Fleet]:
    started = Fleet(broker_base_url, {**RELAYED, "schema": schema})
    yield started
    started.close()


def _names(fleet: Fleet) -> list[str]:
    return [f"pgqueue[{pid}]" for pid in fleet.pids.values()]


def listening(db: psycopg.Connection, fleet: Fleet) -> int:
    """How many of the fleet's sessions are LISTEN sessions (see held_sessions)."""
    return waiting_sessions(db, _names(fleet))


def held(db: psycopg.Connection, fleet: Fleet) -> int:
    """How many sessions the fleet's processes hold."""
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY(%s)",
        (_names(fleet),),
    ).fetchone()
    assert row is not None
    return int(row[0])


def publish(url: str, schema: str, queues: list[str]) -> None:
    with Connection(url, transport_options={"schema": schema}) as conn:
        producer = conn.Producer()
        for name in queues:
            producer.publish({"to": name}, routing_key=name, declare=[Queue(name)])


def test_the_consumers_of_a_host_share_one_listen_session_and_hold_few_sessions_idle(
    fleet: Fleet, db: psycopg.Connection
) -> None:
    fleet.start(range(4), _own)
    wait_for(lambda: listening(db, fleet) == 1, 30, "one LISTEN session for 4 consumers")
    # idle, the consumers' pools close their sessions: the hub's LISTEN session is left
    wait_for(lambda: held(db, fleet) <= 2, 30, "the idle consumers' sessions to close")


def test_each_consumer_gets_its_work_through_the_relay(
    fleet: Fleet, broker_base_url: str, schema: str
) -> None:
    fleet.start(range(4), _own)
    publish(broker_base_url, schema, [f"own.{i}" for i in range(4)] + ["shared"] * 20)
    fleet.until(lambda: sum(len(got) for got in fleet.got.values()) == 24, 30, "24 deliveries")
    for index, got in fleet.got.items():
        assert (f"own.{index}", {"to": f"own.{index}"}) in got
    shared = [body for got in fleet.got.values() for queue, body in got if queue == "shared"]
    assert len(shared) == 20


def test_a_consumer_becomes_the_hub_when_the_hubs_process_is_killed(
    fleet: Fleet, broker_base_url: str, schema: str, db: psycopg.Connection
) -> None:
    fleet.start([0], _own)  # the first: the hub
    fleet.start(range(1, 4), _own)
    wait_for(lambda: listening(db, fleet) == 1, 30, "one LISTEN session")
    fleet.kill(0)
    publish(broker_base_url, schema, [f"own.{i}" for i in range(1, 4)])
    fleet.until(lambda: all(fleet.got[i] for i in range(1, 4)), 30, "a delivery to each")
    wait_for(lambda: listening(db, fleet) == 1, 30, "one LISTEN session again")


def test_200_idle_consumers_fit_in_100_connections_and_each_gets_work(tmp_path: object) -> None:
    """The fleet of issue 43, target 3: 200 consumer processes on a server with
    max_connections 100 (the shared test server allows more), all started, ten at a
    time (a starting consumer holds up to four sessions for a moment: its first
    connection's checks, then its pool's), the server refusing none; each gets a message
    of its own queue, and none fails. (A burst that wakes more consumers at once than
    the server has sessions for makes some wait for one: the server may log refusals
    then, and the consumer's pool tries again.)"""
    with Cluster.primary(name="relay-fleet") as cluster:
        url = embedded.broker_url(cluster.dsn)
        fleet = Fleet(url, {**RELAYED, "schema": "fleet"})
        try:
            for wave in range(20):
                fleet.start(range(wave * 10, (wave + 1) * 10), lambda i: [f"own.{i}"])
            assert len(fleet.pids) == 200
            assert "too many clients" not in cluster.log(), "refused while starting"
            for wave in range(8):
                indexes = range(wave * 25, (wave + 1) * 25)
                publish(url, "fleet", [f"own.{i}" for i in indexes])
                fleet.until(
                    lambda wave=indexes: all(fleet.got[i] for i in wave), 60, "a delivery each"
                )
            assert all(len(got) == 1 for got in fleet.got.values())
        finally:
            fleet.close()


def test_news_of_a_queue_many_consume_wakes_one_consumer(
    fleet: Fleet, broker_base_url: str, schema: str, db: psycopg.Connection
) -> None:
    """The hub wakes the consumer that began waiting last, not every one: the others stay
    idle, holding no session."""
    fleet.start(range(4), _own)
    wait_for(lambda: held(db, fleet) <= 2, 30, "the idle consumers' sessions to close")
    for n in range(1, 6):
        publish(broker_base_url, schema, ["shared"])
        fleet.until(lambda n=n: sum(len(g) for g in fleet.got.values()) == n, 30, f"{n} got")
    takers = [index for index, got in fleet.got.items() if got]
    assert len(takers) == 1, fleet.got


def _relay_addresses() -> set[str]:
    """The relays' names in Linux's abstract namespace, as any local user can list them."""
    with open("/proc/net/unix") as table:
        return {
            line.split()[-1][1:] for line in table if line.split()[-1].startswith("@pgqueue-relay-")
        }


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(b"\0" + address.encode())
    return sock


def test_the_hub_drops_a_client_that_sends_what_is_not_a_message_and_serves_the_rest(
    fleet: Fleet, broker_base_url: str, schema: str
) -> None:
    before = _relay_addresses()
    fleet.start(range(2), _own)
    (address,) = _relay_addresses() - before
    intruder = _connect(address)
    intruder.sendall(b'{"wait": ["own.0"]}\n\x00not json\n')
    intruder.settimeout(30)
    assert intruder.recv(100) == b""  # dropped
    publish(broker_base_url, schema, ["own.0", "own.1"])
    fleet.until(lambda: all(fleet.got[i] for i in range(2)), 30, "a delivery to each")


def test_a_process_of_another_user_cannot_join_the_relay(
    fleet: Fleet, broker_base_url: str, schema: str
) -> None:
    """Queue names travel on the relay's socket: a process of another user that finds
    its name (in /proc/net/unix, as anyone can) is refused."""
    if os.geteuid() != 0:
        # a database test never skips in CI: there it fails, naming what it needs
        why = "switching to another user takes root"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs as root", pytrace=False)
        pytest.skip(why)
    before = _relay_addresses()
    fleet.start(range(1), _own)
    (address,) = _relay_addresses() - before
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user's process: connects, says something, reads
        try:
            os.setuid(65534)
            sock = _connect(address)
            sock.sendall(b'{"wait": ["own.0"]}\n')
            sock.settimeout(30)
            got = sock.recv(100)
            os.write(write, b"closed" if got == b"" else repr(got).encode())
        except ConnectionError:  # reset, or a broken pipe: closed before or while it spoke
            os.write(write, b"closed")
        except BaseException as exc:  # noqa: BLE001 - said to the test
            os.write(write, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as said:
        assert said.read() == "closed"  # nothing said
