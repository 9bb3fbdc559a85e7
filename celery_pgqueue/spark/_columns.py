"""Whole Arrow batches into COPY rows, for the common layouts, without a loop per row.

A row whose arguments are strings of plain printable ASCII (no quote, apostrophe or
backslash) and integers is written the same by ``json.dumps``, ``repr`` and COPY: its
message is the template's fixed text around those values, joined column by column with
Arrow's string kernels. Only the task id (a SHA-1 per row) is computed in Python. Rows
that are not plain (other characters, nulls, over-long keys) are left to the per-row
builder, which knows every case; so are layouts with other column types, a priority,
ETA or expiry that varies per row, or an expiry at all (its ``expiration`` property is
the time left when the row is written).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from hashlib import sha1
from itertools import repeat
from typing import Any

from ._messages import MAX_KEY_BYTES, NAMESPACE, _json, _Template
from ._rows import _Layout

# printable ASCII but for " ' \ : what JSON, repr() and COPY all write unchanged
_PLAIN = r"^[ !#-&(-\[\]-~]*$"
_INTEGERS = ("byte", "short", "integer", "long")
_SLOT = re.compile("\x01(\\d)\x01")
_SALT, _EMPTY = NAMESPACE.bytes, b""


@cache
def _hex_tables() -> tuple[Any, Any]:
    """Each byte's two hex digits, and where a UUID's 16 bytes' digits go in its text."""
    import numpy as np

    digits = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), np.uint8)
    at = [p for p in range(36) if p not in (8, 13, 18, 23)]
    return digits.reshape(256, 2), np.array(at).reshape(16, 2)


def _pieces(template: str, values: dict[int, str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A ``str.format`` template as its fixed text and the slot numbers between them.

    ``values`` fills the slots that are the same for every row."""
    marked = template.format(*(values.get(i, f"\x01{i}\x01") for i in range(6)))
    parts = _SLOT.split(marked)
    return tuple(parts[0::2]), tuple(int(n) for n in parts[1::2])


def _uuid5s(names: Any) -> Any:
    """``_uuid5`` of each string of an Arrow array, as an Arrow array: one SHA-1 call per
    row in Python, the rest in numpy."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    salted = pc.binary_join_element_wise(_SALT, pc.cast(names, pa.binary()), _EMPTY)
    digests = b"".join([sha1(name).digest() for name in salted.to_pylist()])
    raw = np.frombuffer(digests, np.uint8).reshape(-1, 20)[:, :16].copy()
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x50  # version 5
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80  # RFC 4122 variant
    text = np.full((len(raw), 36), ord("-"), np.uint8)
    digits, at = _hex_tables()
    text[:, at] = digits[raw]
    offsets = np.arange(0, 36 * (len(raw) + 1), 36, dtype=np.int32)
    return pa.StringArray.from_buffers(len(raw), pa.py_buffer(offsets), pa.py_buffer(text))


@dataclass(frozen=True, slots=True)
class _Columns:
    """How to build a batch's messages by columns (made on the driver, pickled over)."""

    kinds: tuple[bool, ...]  # per argument and key column: True for a string, False int
    nargs: int
    kwnames: tuple[str, ...]
    keyed: bool
    task: str
    queue: str
    priority: int
    embed: str  # the body's third element, as JSON
    maxlen: int  # of argsrepr and kwargsrepr
    headers: tuple[tuple[str, ...], tuple[int, ...]]
    properties: tuple[tuple[str, ...], tuple[int, ...]]

    @classmethod
    def plan(cls, template: _Template, layout: _Layout) -> _Columns | None:
        """The plan for these column types, or None when only the per-row builder fits.

        For messages without an ETA, expiry or priority column (the caller checks)."""
        types, nargs, kwnames, nkeys = layout.types, layout.nargs, layout.kwnames, layout.nkeys
        if nkeys > 1 or len(types) != nargs + len(kwnames) + nkeys:
            return None
        if any(t not in ("string", *_INTEGERS) for t in types):
            return None
        if any(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is None for name in kwnames):
            return None  # names that repr() and JSON write as they are
        if re.fullmatch(_PLAIN, template.task) is None:
            return None  # the dedup key property is its JSON
        headers = template.headers
        return cls(
            kinds=tuple(t == "string" for t in types),
            nargs=nargs,
            kwnames=kwnames,
            keyed=bool(nkeys),
            task=template.task,
            queue=template.queue,
            priority=template.priority,
            embed=_json(template.embed),
            maxlen=template.maxlen,
            headers=_pieces(headers, {4: "null", 5: "null"}),
            properties=_pieces(template.properties, {1: str(template.priority)}),
        )

    def build(self, batch: Any) -> tuple[list[tuple[Any, ...]], list[int]]:
        """COPY rows for the plain rows of ``batch``, and the positions of the others."""
        import pyarrow as pa
        import pyarrow.compute as pc

        columns = list(batch.columns)
        plain = None
        for column, is_text in zip(columns, self.kinds):
            ok = pc.match_substring_regex(column, _PLAIN) if is_text else pc.is_valid(column)
            plain = ok if plain is None else pc.and_kleene(plain, ok)
        if self.keyed:
            key = columns[-1]
            length = pc.utf8_length(key) if self.kinds[-1] else None
            if length is not None:  # plain text: one byte per character
                room = MAX_KEY_BYTES - len((self.task + ":").encode())
                plain = pc.and_kleene(plain, pc.less_equal(length, room))
        others: list[int] = []
        if plain is not None:
            plain = pc.fill_null(plain, False)
            if not pc.all(plain).as_py():
                others = pc.indices_nonzero(pc.invert(plain)).to_pylist()
                columns = [c.filter(plain) for c in columns]
        count = batch.num_rows - len(others)
        if not count:
            return [], others

        join = pc.binary_join_element_wise

        def text(column: Any, is_text: bool, quote: str) -> Any:
            return join(quote, column, quote, "") if is_text else pc.cast(column, pa.string())

        values = list(zip(columns, self.kinds))[: self.nargs + len(self.kwnames)]
        as_json = [text(c, t, '"') for c, t in values]
        as_repr = [text(c, t, "'") for c, t in values]
        args_json, kw_json = as_json[: self.nargs], as_json[self.nargs :]
        args_repr, kw_repr = as_repr[: self.nargs], as_repr[self.nargs :]
        body_parts: list[Any] = ["[["]
        for i, part in enumerate(args_json):
            body_parts += [", "] * bool(i) + [part]
        body_parts.append("], {")
        for i, (name, part) in enumerate(zip(self.kwnames, kw_json)):
            body_parts += [", "] * bool(i) + [f'"{name}": ', part]
        body_parts.append("}, " + self.embed + "]")
        body = self._join(body_parts, count)

        if self.keyed:
            key_text = text(columns[-1], self.kinds[-1], "")
            dedup_keys = join(self.task + ":", key_text, "")
            ids = _uuid5s(dedup_keys)
            dedup = dedup_keys.to_pylist()
        else:
            ids = _uuid5s(join(self.task + "\x00", body, ""))
            dedup = join("celery:", ids, ":0", "").to_pylist()
        quoted = join('"', ids, '"', "")

        args_text: list[Any] = ["("]
        for i, part in enumerate(args_repr):
            args_text += [", "] * bool(i) + [part]
        args_text.append(",)" if len(args_repr) == 1 else ")")
        kw_text: list[Any] = ["{"]
        for i, (name, part) in enumerate(zip(self.kwnames, kw_repr)):
            kw_text += [", "] * bool(i) + [f"'{name}': ", part]
        kw_text.append("}")
        slots = {
            0: quoted,
            1: quoted,
            2: self._repr_json(args_text, count),
            3: self._repr_json(kw_text, count),
        }
        headers = self._fill(self.headers, slots, count)
        if self.keyed:
            slots[3] = join('"', dedup_keys, '"', "")
        else:
            slots[3] = "null"
        properties = self._fill(self.properties, slots, count)
        rows = list(
            zip(
                repeat(self.queue),
                repeat(self.priority),
                repeat(None),
                repeat(None),
                dedup,
                pc.cast(body, pa.binary()).to_pylist(),
                repeat("application/json"),
                repeat("utf-8"),
                headers.to_pylist(),
                properties.to_pylist(),
            )
        )
        return rows, others

    @staticmethod
    def _join(parts: list[Any], count: int) -> Any:
        import pyarrow as pa
        import pyarrow.compute as pc

        if all(isinstance(p, str) for p in parts):
            return pa.array(["".join(parts)] * count, pa.string())
        return pc.binary_join_element_wise(*parts, "")

    def _repr_json(self, parts: list[Any], count: int) -> Any:
        """``encode_basestring_ascii(repr(...)[:maxlen])`` of plain values."""
        import pyarrow.compute as pc

        text = self._join(parts, count)
        text = pc.utf8_slice_codeunits(text, 0, self.maxlen)
        return pc.binary_join_element_wise('"', text, '"', "")

    def _fill(
        self, template: tuple[tuple[str, ...], tuple[int, ...]], slots: dict[int, Any], count: int
    ) -> Any:
        fixed, order = template
        parts: list[Any] = [fixed[0]]
        for slot, after in zip(order, fixed[1:]):
            parts += [slots[slot], after]
        return self._join([p for p in parts if not (isinstance(p, str) and not p)], count)
