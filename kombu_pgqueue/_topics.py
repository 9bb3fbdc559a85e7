"""Topic bindings as PostgreSQL regular expressions, matching as Kombu's own do."""

from __future__ import annotations

import re

from kombu.transport.virtual.exchange import TopicExchange
from kombu.utils.text import escape_regex

from .exceptions import ConfigurationError

#: a topic binding's wildcard words, as PostgreSQL regular expressions
_TOPIC_WILDCARDS = {"*": r"[^.]+", "#": r"[^\n]*?"}


def topic_pattern(binding_key: str) -> str:
    """Return the PostgreSQL regular expression that routes ``binding_key`` as Kombu does.

    Kombu matches topic bindings with Python's ``re``, where ``.`` does not cross a
    newline and a final ``$`` also matches before a trailing newline; PostgreSQL's ``.``
    and ``$`` do neither. Words are escaped exactly as Kombu escapes them.
    """
    words = escape_regex(binding_key, ".#*").split(".")
    try:
        # Kombu leaves a '*' or '#' inside a word unescaped; where that makes its pattern
        # invalid, no message could be routed through the binding (PostgreSQL rejects
        # exactly those patterns too), so the binding is refused, not stored
        re.compile(r"\.".join(TopicExchange.wildcards.get(word, word) for word in words))
    except re.error as exc:
        raise ConfigurationError(
            f"topic binding key {binding_key!r} is not a valid pattern ({exc}): '*' and '#' "
            "are wildcards only as whole words between dots; inside a word Kombu reads "
            "them as parts of a regular expression"
        ) from exc
    body = r"\.".join(_TOPIC_WILDCARDS.get(word, word) for word in words)
    return f"^{body}\\n?$"
