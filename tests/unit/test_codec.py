"""The consumer's JSON decoding of headers and properties agrees with Kombu's."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps, loads

from kombu_pgqueue.codec import _loads

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
    st.datetimes(timezones=st.just(timezone.utc)),
    st.uuids(),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.sampled_from(["__type__", "__value__", "\\u005f", "ü"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(VALUES)
def test_loads_agrees_with_kombus_loads_on_what_kombu_dumps(value: Any) -> None:
    text = dumps({"headers": value})
    assert _loads(text) == loads(text)


def test_loads_restores_kombus_typed_values() -> None:
    when = datetime(2026, 11, 24, 4, 0, tzinfo=timezone.utc)
    ident = uuid.uuid4()
    text = dumps({"eta": when, "id": ident, "amount": Decimal("1.5")})
    assert _loads(text) == {"eta": when, "id": ident, "amount": Decimal("1.5")}


def test_an_escaped_type_key_still_goes_through_kombus_hook() -> None:
    # "\u005f" is "_": only the hook may turn this object into a datetime
    text = '{"\\u005f_type__": "datetime", "__value__": "2026-11-24T04:00:00+00:00"}'
    assert _loads(text) == loads(text) == datetime(2026, 11, 24, 4, 0, tzinfo=timezone.utc)
