"""Typed views of the unannotated Kombu functions that celery_pgqueue calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from kombu import serialization
from kombu.utils import json as kombu_json

#: ``serialize(body, serializer=name)`` -> (content_type, content_encoding, payload)
serialize = cast(Callable[..., "tuple[str, str, bytes | str]"], serialization.dumps)

#: JSON with Kombu's encodings of datetimes, UUIDs, Decimals ...
json_dumps = cast(Callable[[Any], str], kombu_json.dumps)

#: and back
json_loads = cast(Callable[[str | bytes], Any], kombu_json.loads)
