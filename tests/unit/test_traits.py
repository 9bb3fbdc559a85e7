"""What each statement needs from the code that sends it (``_sql.traits``): read from
its parameters where it takes one, declared by name otherwise, and never declared for a
statement that does not exist."""

from __future__ import annotations

import pytest

from kombu_pgqueue import _sql
from kombu_pgqueue._sql import Traits


def test_traits_follow_the_parameters_a_statement_takes() -> None:
    traits = _sql.traits()
    assert traits["claim"] == Traits(floor=True, relaxed=True)
    assert traits["ack"] == Traits(floor=True, relaxed=True, fenced=True)
    assert traits["publish"] == Traits(publish=True, attempt=True)
    assert traits["publish_replacing"] == Traits(floor=True, publish=True, attempt=True)
    # a bulk load is a publish, but not one attempt's: statement_timeout alone bounds it
    assert traits["publish_many"] == Traits(publish=True)
    assert traits["queue_depths"] == Traits()


def test_traits_declared_for_a_statement_that_does_not_exist_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sql, "FENCED", _sql.FENCED | {"akc"})
    _sql.traits.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="akc"):
            _sql.traits()
    finally:
        monkeypatch.undo()
        _sql.traits.cache_clear()
