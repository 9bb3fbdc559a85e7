"""parse_options, build_conninfo, notify_channel, check_name: pure functions, no database."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from kombu_pgqueue import ConfigurationError
from kombu_pgqueue._options import (
    LIBPQ_KEYWORDS,
    Options,
    build_conninfo,
    check_name,
    check_schema,
    mask,
    notify_channel,
    parse_options,
)
from kombu_pgqueue._topics import topic_pattern


def test_parse_options_defaults_match_the_documented_ones() -> None:
    options = parse_options({})

    assert options == Options()
    assert options.schema == "pgqueue"
    assert options.visibility_timeout == 60.0
    assert options.renewal_interval == 20.0
    assert options.max_attempts == 5
    assert options.polling_interval == 5.0
    assert options.listen is True
    assert options.auto_migrate is True
    assert options.libpq == {}


def test_parse_options_reads_strings_as_numbers_and_flags() -> None:
    options = parse_options(
        {
            "visibility_timeout": "10",
            "lease_renewal_interval": "2.5",
            "max_attempts": "0",
            "listen": "off",
            "auto_migrate": "yes",
            "prepare_threshold": None,
        }
    )

    assert options.visibility_timeout == 10.0
    assert options.renewal_interval == 2.5
    assert options.claim_attempt_limit == 2**31 - 1  # 0 turns the limit off
    assert options.listen is False
    assert options.auto_migrate is True
    assert options.prepare_threshold is None


def test_pacing_options_take_infinity_to_turn_their_behaviour_off() -> None:
    options = parse_options({"slow_claim_seconds": "inf", "idle_inline_seconds": float("inf")})

    assert options.slow_claim_seconds == float("inf")  # no claim counts as slow
    assert options.idle_inline_seconds == float("inf")  # no claim goes inline
    assert options.resume_seconds == 1.0


def test_parse_options_ignores_kombu_retry_policy_keys() -> None:
    options = parse_options({"max_retries": 3, "interval_start": 0, "confirm_publish": True})

    assert options == Options()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("visibility_timeout", "soon"),
        ("visibility_timeout", 0.5),
        ("visibility_timeout", -1),
        ("visibility_timeout", "nan"),
        ("resume_seconds", -1),
        ("slow_claim_seconds", "slow"),
        ("idle_inline_seconds", float("nan")),
        ("polling_interval", 0),
        ("sweep_interval", "x"),
        ("pool_timeout", 0.0),
        ("pool_max_idle", 0.1),
        ("lease_renewal_interval", 0.01),
        ("max_attempts", -1),
        ("max_attempts", "three"),
        ("pool_max_size", 1),
        ("prepare_threshold", -1),
        ("prepare_threshold", "never"),
        ("listen", "maybe"),
        ("listen", 2),
        ("auto_migrate", None),
        ("schema", ""),
        ("schema", "s" * 64),
        ("schema", "é" * 32),  # 64 bytes in UTF-8
        ("schema", "bad\x00schema"),
        ("schema", 42),
    ],
)
def test_parse_options_rejects_bad_values(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_options({key: value})

    assert isinstance(caught.value, ValueError)
    assert key in str(caught.value)


def test_parse_options_rejects_renewal_not_shorter_than_the_lease() -> None:
    with pytest.raises(ConfigurationError, match="lease_renewal_interval"):
        parse_options({"visibility_timeout": 5, "lease_renewal_interval": 5})


def test_parse_options_accepts_a_63_byte_schema() -> None:
    assert parse_options({"schema": "s" * 63}).schema == "s" * 63


def test_parse_options_collects_libpq_keywords() -> None:
    options = parse_options(
        {
            "sslmode": "disable",
            "application_name": "billing",
            "keepalives_idle": 30,
            "libpq": {"target_session_attrs": "read-write", "connect_timeout": 7},
            "visibility_timeout": 30,
        }
    )

    assert dict(options.libpq) == {
        "sslmode": "disable",
        "application_name": "billing",
        "keepalives_idle": "30",
        "target_session_attrs": "read-write",
        "connect_timeout": "7",
    }
    assert "visibility_timeout" not in options.libpq


def test_parse_options_libpq_dict_overrides_top_level_keywords() -> None:
    options = parse_options({"sslmode": "disable", "libpq": {"sslmode": "require"}})

    assert options.libpq["sslmode"] == "require"


def test_parse_options_rejects_unknown_libpq_parameters() -> None:
    with pytest.raises(ConfigurationError, match="sslmoed"):
        parse_options({"libpq": {"sslmoed": "require"}})


def test_libpq_keywords_come_from_libpq() -> None:
    assert {"host", "port", "dbname", "user", "sslmode", "application_name"} <= LIBPQ_KEYWORDS


def test_build_conninfo_from_kombu_fields() -> None:
    conninfo = build_conninfo(
        hostname="db.example",
        port=5433,
        userid="celery",
        password="p@ss word;'",
        virtual_host="/broker",
        connect_timeout=None,
    )

    params = conninfo_to_dict(conninfo)
    assert params == {
        "host": "db.example",
        "port": "5433",
        "user": "celery",
        "password": "p@ss word;'",
        "dbname": "broker",
        "application_name": f"pgqueue[{os.getpid()}]",
    }


def test_build_conninfo_root_virtual_host_names_no_database() -> None:
    params = conninfo_to_dict(
        build_conninfo(hostname="h", port=None, userid=None, password=None, virtual_host="/")
    )

    assert "dbname" not in params
    assert "port" not in params
    assert "user" not in params


@pytest.mark.parametrize(("seconds", "expected"), [(0.5, "2"), (1, "2"), (2.1, "3"), (5, "5")])
def test_build_conninfo_rounds_connect_timeout_up(seconds: float, expected: str) -> None:
    params = conninfo_to_dict(
        build_conninfo(
            hostname="h",
            port=None,
            userid=None,
            password=None,
            virtual_host=None,
            connect_timeout=seconds,
        )
    )

    assert params["connect_timeout"] == expected


def test_build_conninfo_libpq_options_win() -> None:
    params = conninfo_to_dict(
        build_conninfo(
            hostname="h",
            port=None,
            userid=None,
            password=None,
            virtual_host="/db",
            connect_timeout=5,
            libpq={"application_name": "mine", "connect_timeout": "11", "sslmode": "require"},
        )
    )

    assert params["application_name"] == "mine"
    assert params["connect_timeout"] == "11"
    assert params["sslmode"] == "require"


def test_build_conninfo_takes_a_libpq_url_as_hostname() -> None:
    params = conninfo_to_dict(
        build_conninfo(
            hostname="postgresql://app@db1:5439/jobs?sslmode=require&target_session_attrs=any",
            port=None,
            userid=None,
            password=None,
            virtual_host=None,
        )
    )

    assert params["host"] == "db1"
    assert params["port"] == "5439"
    assert params["user"] == "app"
    assert params["dbname"] == "jobs"
    assert params["sslmode"] == "require"
    assert params["target_session_attrs"] == "any"


def test_build_conninfo_libpq_url_takes_gaps_from_kombu_fields() -> None:
    # the docstring: "the other fields then only fill gaps" (Celery passes
    # broker_user / broker_password as userid / password)
    params = conninfo_to_dict(
        build_conninfo(
            hostname="postgresql://db1/jobs",
            port=None,
            userid="celery",
            password="secret",
            virtual_host=None,
        )
    )

    assert params["host"] == "db1"
    assert params["user"] == "celery"
    assert params["password"] == "secret"


def test_build_conninfo_rejects_an_unparseable_url_without_leaking_the_password() -> None:
    with pytest.raises(ConfigurationError) as caught:
        build_conninfo(
            hostname="postgresql://u:hunter2@h/db?nosuchoption=1",
            port=None,
            userid=None,
            password=None,
            virtual_host=None,
        )

    assert isinstance(caught.value, ValueError)
    assert "hunter2" not in str(caught.value)


def test_build_conninfo_rejects_unknown_libpq_keywords() -> None:
    with pytest.raises(ConfigurationError):
        build_conninfo(
            hostname="h",
            port=None,
            userid=None,
            password=None,
            virtual_host=None,
            libpq={"nosuchoption": "1"},
        )


def test_mask_hides_the_password() -> None:
    masked = mask("host=h user=u password=hunter2 dbname=d")

    assert "hunter2" not in masked
    assert conninfo_to_dict(masked)["password"] == "**"
    assert mask("not a = valid 'conninfo") == "<unparseable connection string>"


def test_notify_channel_is_namespaced_by_schema() -> None:
    assert notify_channel("pgqueue") == "pgqueue.notify"
    assert notify_channel("a") != notify_channel("b")


@pytest.mark.parametrize("schema", ["s" * 56, "s" * 57, "s" * 63, "é" * 31, "队" * 21, "x"])
def test_notify_channel_fits_in_63_bytes(schema: str) -> None:
    channel = notify_channel(schema)

    assert 0 < len(channel.encode()) <= 63


def test_notify_channel_long_schemas_stay_distinct() -> None:
    first, second = notify_channel("s" * 62 + "a"), notify_channel("s" * 62 + "b")

    assert first != second
    assert notify_channel("s" * 62 + "a") == first  # stable across processes


@pytest.mark.parametrize(
    "name", ["", "plain", "it's", "semi;colon", "with space", "ünï ☃ 队列", "x" * 300]
)
def test_check_name_accepts_any_text_without_nul(name: str) -> None:
    assert check_name("queue", name) == name


@pytest.mark.parametrize("name", ["a\x00b", "\x00", None, 7, b"bytes"])
def test_check_name_rejects_nul_and_non_strings(name: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_name("queue", name)

    assert isinstance(caught.value, ValueError)
    assert "queue" in str(caught.value)


def test_check_schema_rejects_empty_and_long_names() -> None:
    assert check_schema("ok") == "ok"
    with pytest.raises(ConfigurationError):
        check_schema("")
    with pytest.raises(ConfigurationError):
        check_schema("s" * 64)


def test_synchronous_commit_becomes_a_session_option() -> None:
    from kombu_pgqueue._options import parse_options as parse

    options = parse({"synchronous_commit": "off", "options": "-c work_mem=8MB"})
    assert options.libpq["options"] == "-c work_mem=8MB -c synchronous_commit=off"


def test_synchronous_commit_rejects_unknown_values() -> None:
    import pytest

    from kombu_pgqueue import ConfigurationError
    from kombu_pgqueue._options import parse_options as parse

    with pytest.raises(ConfigurationError, match="synchronous_commit"):
        parse({"synchronous_commit": "sometimes"})


def test_topic_pattern_keeps_kombus_newline_rules_in_postgresql_syntax() -> None:
    # '#' may not cross a newline (Python's .), and a trailing newline may follow the
    # key (Python's $); words are escaped as Kombu escapes them
    assert topic_pattern("#") == r"^[^\n]*?\n?$"
    assert topic_pattern("a.*.b") == r"^a\.[^.]+\.b\n?$"
    assert topic_pattern("q(x)") == r"^q\(x\)\n?$"


@pytest.mark.parametrize("key", ["*0", "a.**", "a*b**"])
def test_topic_pattern_refuses_a_key_no_message_could_pass(key: str) -> None:
    with pytest.raises(ConfigurationError, match=f"topic binding key {re.escape(repr(key))}"):
        topic_pattern(key)


def test_async_claims_is_on_by_default_and_claim_thread_is_its_former_name() -> None:
    assert parse_options({}).async_claims is True
    assert parse_options({"async_claims": False}).async_claims is False
    assert parse_options({"claim_thread": False}).async_claims is False
    assert parse_options({"claim_thread": False, "async_claims": True}).async_claims is True


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("visiblity_timeout", "visibility_timeout"), ("max_attempt", "max_attempts")],
)
def test_a_misspelled_option_warns_once_naming_the_closest_one(
    typo: str, meant: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        options = parse_options({typo: 7})
        parse_options({typo: 7})

    assert options == Options()  # ignored, as before
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1
    assert repr(typo) in warned[0] and repr(meant) in warned[0]


def test_valid_options_are_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    valid = {"schema": "s", "visibility_timeout": 9, "statement_timeout": 3, "sslmode": "off"}
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        parse_options(
            {**valid, "polling_interval": 1, "libpq": {}, "async_claims": True}
            | {"synchronous_commit": "off"}
        )

    assert caplog.records == []


def test_options_of_kombu_and_other_brokers_are_ignored_without_a_guess(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kombu_pgqueue"):
        parse_options({"max_retries": 3, "interval_start": 0, "confirm_publish": True})
        parse_options({"fanout_prefix": True, "sep": ":"})

    assert [r.getMessage() for r in caplog.records if "did you mean" in r.getMessage()] == []


def test_check_schema_refuses_a_name_postgresql_reserves_in_one_line() -> None:
    """``pg_jobs`` reached the server and came back as a 49-line traceback ending in
    ReservedName (a newcomer's trial)."""
    with pytest.raises(ConfigurationError, match="reserves names that begin with 'pg_'"):
        check_schema("pg_jobs")
    # PostgreSQL's check is case-sensitive, on a quoted name
    assert check_schema("PG_jobs") == "PG_jobs"
    assert check_schema("jobs_pg_") == "jobs_pg_"


def test_every_transport_option_is_documented_where_users_are_sent() -> None:
    """docs/configuration.md lists the transport options, one place for all of them (the
    README, the transport's docstring and the admin API send users there)."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    listed = set(
        re.findall(r"^- `(\w+)`", docs.read_text().split("\n## Transport options\n", 1)[1], re.M)
    )
    fields = {f.name for f in dataclasses.fields(Options)}
    assert fields - listed == set(), "options not in docs/configuration.md"
    # the names accepted beside the fields: libpq keywords, synchronous_commit (to libpq)
    assert listed - fields <= {"libpq", "synchronous_commit"}, "documented, not an option"


def test_relay_is_off_by_default_and_closes_idle_sessions_sooner_unless_told() -> None:
    assert parse_options({}).relay is False
    relayed = parse_options({"relay": "true"})
    assert relayed.relay is True
    assert relayed.pool_max_idle == 2.0
    assert parse_options({"relay": True, "pool_max_idle": 20}).pool_max_idle == 20
    assert parse_options({}).pool_max_idle == 30.0
