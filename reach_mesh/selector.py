"""The selector language: which agents may take a task.

A selector is a conjunction of terms::

    cap=email:send:v1 AND region=cn-east AND mem_gte=8GiB AND gpu exists AND tier!=free

This module is pure (no I/O): it parses selectors, normalises numeric labels into quantities and
holds the brute-force reference semantics (:meth:`Selector.matches`). The hub's inverted index
(:mod:`reach_mesh.hub.index`) must agree with :meth:`Selector.matches` for every agent; the grammar
and the unit rules are written down in ``docs/selectors.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Final, Literal, TypeAlias

from reach_mesh.errors import SelectorError

__all__ = [
    "CAPABILITY_KEY",
    "CAPABILITY_RE",
    "COMPARISON_OPS",
    "KEY_RE",
    "MAX_SELECTOR_LENGTH",
    "MAX_SELECTOR_TERMS",
    "Op",
    "Selector",
    "Term",
    "label_quantities",
    "parse_quantity",
]

Op: TypeAlias = Literal["=", "!=", "exists", "!exists", ">=", "<=", ">", "<"]

#: Longest selector text accepted; selectors arrive over the wire, so the parser is bounded.
MAX_SELECTOR_LENGTH: Final = 4096
#: Most terms a selector may have (explaining a no-match weighs each against each candidate).
MAX_SELECTOR_TERMS: Final = 32
#: The reserved key whose ``=``/``!=`` terms test capabilities instead of labels.
CAPABILITY_KEY: Final = "cap"
CAPABILITY_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]*:[a-z0-9][a-z0-9_-]*:v[0-9]+", re.ASCII)
KEY_RE: Final = re.compile(r"[a-z0-9][a-z0-9_.-]*", re.ASCII)
COMPARISON_OPS: Final[frozenset[str]] = frozenset({">=", "<=", ">", "<"})

# Selector key suffix -> comparison operator (``mem_gte=8GiB`` compares the ``mem`` quantity).
_SUFFIX_TO_OP: Final[dict[str, Op]] = {"gte": ">=", "lte": "<=", "gt": ">", "lt": "<"}
_OP_TO_SUFFIX: Final[dict[str, str]] = {op: suffix for suffix, op in _SUFFIX_TO_OP.items()}
# Non-greedy base so that ``x_gt_gte`` splits as base ``x_gt``, suffix ``gte``.
_COMPARISON_KEY_RE: Final = re.compile(r"(.+?)_(gte|lte|gt|lt)", re.ASCII)

# Units in a *value* (``8GiB``, ``500GB``): binary with ``i``, decimal without, as the SI/IEC
# standards say.
_VALUE_UNITS: Final[dict[str, float]] = {
    "b": 1.0,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
# Units in a label *key suffix* (``mem_gb=16``) are binary by convention: people writing memory
# and disk sizes as labels mean GiB when they write ``_gb``; reading them as decimal would make
# ``mem_gb=16`` fail ``mem_gte=16GiB``.
_KEY_SUFFIX_UNITS: Final[dict[str, float]] = {
    "b": 1.0,
    "kb": 2.0**10,
    "mb": 2.0**20,
    "gb": 2.0**30,
    "tb": 2.0**40,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
_KEY_SUFFIX_RE: Final = re.compile(r"(.+)_(b|kb|mb|gb|tb|kib|mib|gib|tib)", re.ASCII)
# ASCII digits only: ``float()`` would also accept Arabic-Indic digits, ``nan`` and ``inf``.
# Matched against stripped text of at most ``_QUANTITY_MAX`` characters: two runs of optional
# spaces side by side made a long run of spaces cost quadratic time (tens of ms per value).
_QUANTITY_RE: Final = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)[ \t]*([a-zA-Z]*)",
    re.ASCII,
)
_QUANTITY_MAX: Final = 64

# Whitespace between tokens. Deliberately ASCII: the canonical form must quote exactly the values
# the parser would otherwise split.
_WS: Final = frozenset(" \t\r\n\f\v")
_QUOTES: Final = frozenset("\"'")
_KEY_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")
_BARE_VALUE_RE: Final = re.compile(r"[^ \t\r\n\f\v\"']+")
_TERM_EXPECTED: Final = "a term (key=value, key!=value, key exists, key !exists, key_gte=N, …)"
_OP_EXPECTED: Final = "'=', '!=', 'exists' or '!exists'"
_QUANTITY_EXPECTED: Final = "a number, optionally with a byte unit (B, KB, KiB, MB, MiB, …)"


def _quantity_and_unit(text: str) -> tuple[float, bool] | None:
    """``(value, has_unit)`` for a quantity, or ``None``; the value is in bytes if it had a unit."""
    text = text.strip(" \t\r\n\f\v")
    if len(text) > _QUANTITY_MAX:
        return None
    m = _QUANTITY_RE.fullmatch(text)
    if m is None:
        return None
    number = float(m.group(1))
    unit = m.group(2)
    if unit:
        multiplier = _VALUE_UNITS.get(unit.lower())
        if multiplier is None:
            return None
        number *= multiplier
    # An exponent can overflow to inf; infinities would make every comparison degenerate.
    if not math.isfinite(number):
        return None
    return number, bool(unit)


def parse_quantity(text: str) -> float | None:
    """Parse a number or a byte size, or return ``None`` if ``text`` is neither.

    Plain numbers may be negative and fractional (``-1.5``, ``8``, ``2e3``). Byte units are
    case-insensitive: ``B``; decimal ``KB MB GB TB`` (10^3 …); binary ``KiB MiB GiB TiB``
    (2^10 …). ``8GiB`` and ``8 gib`` are both ``8 * 2**30``. Non-finite values are rejected.
    """
    parsed = _quantity_and_unit(text)
    return None if parsed is None else parsed[0]


def label_quantities(key: str, value: str) -> list[tuple[str, float]]:
    """The numeric quantities a label contributes, as ``(key, quantity)`` pairs.

    - ``cpu=8`` gives ``[("cpu", 8.0)]``; ``mem=16GiB`` gives ``[("mem", 17179869184.0)]``.
    - A byte-unit key suffix (``_b _kb _mb _gb _tb`` and ``_kib _mib _gib _tib``) also gives the
      base key in bytes: ``mem_gb=16`` gives ``[("mem_gb", 16.0), ("mem", 16 * 2**30)]``. Key
      suffixes are **binary** by convention (``_gb`` means GiB), because that is what people
      mean when they label memory and disk sizes.
    - If such a suffixed key has a value with its own unit (``mem_gb=16GiB``), the suffixed key
      holds it in the suffix's unit (``16.0``) and the base key in bytes.
    - A non-numeric value gives ``[]``.
    """
    parsed = _quantity_and_unit(value)
    if parsed is None:
        return []
    number, has_unit = parsed
    m = _KEY_SUFFIX_RE.fullmatch(key)
    if m is None:
        return [(key, number)]
    base, multiplier = m.group(1), _KEY_SUFFIX_UNITS[m.group(2)]
    if has_unit:
        return [(key, number / multiplier), (base, number)]
    return [(key, number), (base, number * multiplier)]


def _format_value(value: str) -> str:
    """A value as the canonical text the parser reads back to the same string."""
    if _BARE_VALUE_RE.fullmatch(value):
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


@dataclass(frozen=True, slots=True)
class Term:
    """One condition of a selector.

    ``key`` is the label key (for comparisons, the base key: ``mem_gte=8GiB`` has key ``mem``),
    or ``cap`` for capability terms. ``value`` is the raw value text (``None`` for ``exists`` /
    ``!exists``); ``number`` is the parsed quantity of a comparison. ``position`` is where the
    term starts in the parsed text; it is not part of equality, so a canonical re-parse compares
    equal.
    """

    key: str
    op: Op
    value: str | None = None
    number: float | None = None
    position: int = field(default=0, compare=False)

    def __str__(self) -> str:
        if self.op == "exists":
            return f"{self.key} exists"
        if self.op == "!exists":
            return f"{self.key} !exists"
        value = _format_value(self.value or "")
        if self.op in COMPARISON_OPS:
            return f"{self.key}_{_OP_TO_SUFFIX[self.op]}={value}"
        return f"{self.key}{self.op}{value}"

    @property
    def is_capability(self) -> bool:
        """Whether the term tests capabilities (``cap=…`` / ``cap!=…``)."""
        return self.key == CAPABILITY_KEY

    def matches(self, capabilities: Collection[str], labels: Mapping[str, str]) -> bool:
        """Reference semantics of this term for one agent (see :meth:`Selector.matches`)."""
        op = self.op
        if self.key == CAPABILITY_KEY:
            return (self.value in capabilities) == (op == "=")
        if op == "=":
            return labels.get(self.key) == self.value
        if op == "!=":
            # A missing label is "not equal": ``tier!=free`` admits agents without a tier.
            return labels.get(self.key) != self.value
        if op == "exists" or op == "!exists":
            present = self.key in labels or any(
                k == self.key for lk, lv in labels.items() for k, _ in label_quantities(lk, lv)
            )
            return present == (op == "exists")
        bound = self.number
        assert bound is not None  # comparisons always carry their parsed number
        for lk, lv in labels.items():
            for k, q in label_quantities(lk, lv):
                if k == self.key and _compare(q, op, bound):
                    return True
        return False


def _compare(quantity: float, op: str, bound: float) -> bool:
    if op == ">=":
        return quantity >= bound
    if op == "<=":
        return quantity <= bound
    if op == ">":
        return quantity > bound
    return quantity < bound


@dataclass(frozen=True)
class Selector:
    """A parsed selector: terms joined by ``AND``. Build it with :meth:`parse`."""

    terms: tuple[Term, ...]

    @classmethod
    def parse(cls, text: str) -> Selector:
        """Parse selector text; raises :class:`~reach_mesh.errors.SelectorError` naming the
        0-based position and what was expected there (``details``: ``position``, ``expected``).
        """
        return cls(_parse_terms(text))

    def __str__(self) -> str:
        return " AND ".join(str(term) for term in self.terms)

    @property
    def capabilities(self) -> tuple[str, ...]:
        """The capabilities the selector requires (the ``cap=`` values), in order."""
        return tuple(
            t.value for t in self.terms if t.op == "=" and t.key == CAPABILITY_KEY and t.value
        )

    @property
    def task_capability(self) -> str | None:
        """The capability a task routed by this selector is sent with (the envelope's
        ``capability``): the first ``cap=`` value, or ``None`` when there is none. Proxy mode
        (the hub) and direct mode (the client) both use this, so a multi-handler agent gets the
        same envelope either way."""
        caps = self.capabilities
        return caps[0] if caps else None

    def matches(self, capabilities: Collection[str], labels: Mapping[str, str]) -> bool:
        """Brute-force reference semantics: does an agent with these capabilities and labels
        satisfy every term?

        - ``cap=X``: ``X`` is one of the capabilities; ``cap!=X``: it is not.
        - ``key=value``: the raw label value equals ``value``; ``key!=value``: it does not, or the
          label is absent.
        - ``key exists``: the label is present, or a quantity of that key is derived from another
          label (``mem`` from ``mem_gb``); ``key !exists``: neither.
        - ``key_gte=N`` etc.: some quantity of ``key`` (see :func:`label_quantities`) satisfies it.
        """
        return all(term.matches(capabilities, labels) for term in self.terms)


def _fail(text: str, position: int, expected: str, hint: str = "") -> SelectorError:
    found = repr(text[position : position + 12]) if position < len(text) else "end of selector"
    return SelectorError(
        f"bad selector at position {position}: expected {expected}, found {found}{hint}",
        position=position,
        expected=expected,
    )


@lru_cache(maxsize=1024)
def _parse_terms(text: str) -> tuple[Term, ...]:
    # Cached: the same few selectors arrive on every request, and the result is immutable.
    # Exceptions are not cached by lru_cache, so bad selectors are re-parsed (cheaply) each time.
    if not isinstance(text, str):
        raise SelectorError("selector must be a string", position=0, expected="a string")
    if len(text) > MAX_SELECTOR_LENGTH:
        raise _fail(text, MAX_SELECTOR_LENGTH, f"at most {MAX_SELECTOR_LENGTH} characters")
    n = len(text)
    terms: list[Term] = []
    pos = _skip_ws(text, 0)
    while True:
        if len(terms) == MAX_SELECTOR_TERMS:
            # Explaining a no-match compares every term with every candidate's: bounded.
            raise _fail(text, pos, f"end of selector (at most {MAX_SELECTOR_TERMS} terms)")
        term, pos = _parse_term(text, pos)
        terms.append(term)
        pos = _skip_ws(text, pos)
        if pos >= n:
            return tuple(terms)
        # ``AND`` must stand alone; a trailing ``AND`` then fails below as a missing term.
        if text[pos : pos + 3].lower() != "and" or (pos + 3 < n and text[pos + 3] not in _WS):
            expected = "'AND' or end of selector"
            if _keyword_at(text.lower(), pos, "or"):
                expected += " (terms are only ANDed: no OR; route to each alternative instead)"
            raise _fail(text, pos, expected)
        pos = _skip_ws(text, pos + 3)


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


def _keyword_at(text: str, pos: int, word: str) -> bool:
    """Whether ``word`` (case-insensitive) starts at ``pos`` and ends at a token boundary."""
    end = pos + len(word)
    return text[pos:end].lower() == word and (end >= len(text) or text[end] not in _KEY_CHARS)


def _op_hint(text: str, start: int, pos: int) -> str:
    """What a term missing its operator most likely meant: a bare capability (``--selector
    email:send:v1``) or a label written with a colon (``region:eu-west``)."""
    cap = CAPABILITY_RE.match(text, start)
    if cap is not None and (cap.end() == len(text) or text[cap.end()] in _WS):
        return f" (a capability is tested as cap={cap.group()})"
    if text.startswith(":", pos):
        return " (labels are tested as key=value, capabilities as cap=domain:action:vN)"
    return ""


def _parse_term(text: str, pos: int) -> tuple[Term, int]:
    start = pos
    m = KEY_RE.match(text, pos)
    if m is None:
        upper = KEY_RE.match(text.lower(), pos)
        if upper is not None and pos < len(text) and text[pos].isupper():
            # Keys are lower case (label keys and cap): name the fix, not only the grammar.
            raise _fail(text, pos, f"{_TERM_EXPECTED}; keys are lower case: {upper.group()!r}")
        raise _fail(text, pos, _TERM_EXPECTED)
    raw_key = m.group()
    pos = _skip_ws(text, m.end())
    op_pos = pos
    if text.startswith("!=", pos):
        op: Op = "!="
        pos += 2
    elif text.startswith("=", pos):
        op = "="
        pos += 1
    elif text.startswith("!", pos) and _keyword_at(text, pos + 1, "exists"):
        op = "!exists"
        pos += 7
    elif _keyword_at(text, pos, "exists"):
        op = "exists"
        pos += 6
    else:
        raise _fail(text, pos, _OP_EXPECTED, hint=_op_hint(text, start, pos))

    if raw_key == CAPABILITY_KEY and op not in ("=", "!="):
        raise _fail(text, op_pos, "'=' or '!=' after 'cap'")
    if op == "exists" or op == "!exists":
        return Term(raw_key, op, None, None, start), pos

    value_pos = _skip_ws(text, pos)
    value, pos = _parse_value(text, value_pos)

    if raw_key == CAPABILITY_KEY:
        if CAPABILITY_RE.fullmatch(value) is None:
            raise _fail(text, value_pos, "a capability domain:action:vN (e.g. email:send:v1)")
        return Term(raw_key, op, value, None, start), pos

    cm = _COMPARISON_KEY_RE.fullmatch(raw_key)
    if cm is None:
        return Term(raw_key, op, value, None, start), pos
    # ``mem_gte=…``: a numeric comparison on the base key.
    if op != "=":
        raise _fail(text, op_pos, f"'=' after comparison key {raw_key!r}")
    base = cm.group(1)
    if base == CAPABILITY_KEY:
        raise _fail(text, start, "a comparison on a label key ('cap' is not numeric)")
    number = parse_quantity(value)
    if number is None:
        raise _fail(text, value_pos, _QUANTITY_EXPECTED)
    return Term(base, _SUFFIX_TO_OP[cm.group(2)], value, number, start), pos


def _parse_value(text: str, pos: int) -> tuple[str, int]:
    """A bare value (no whitespace, no quotes) or a quoted one with ``\\`` escapes."""
    n = len(text)
    if pos >= n:
        raise _fail(text, pos, "a value")
    quote = text[pos]
    if quote not in _QUOTES:
        m = _BARE_VALUE_RE.match(text, pos)
        if m is None:
            raise _fail(text, pos, "a value")
        return m.group(), m.end()
    chars: list[str] = []
    i = pos + 1
    while i < n:
        ch = text[i]
        if ch == "\\" and i + 1 < n:
            chars.append(text[i + 1])
            i += 2
        elif ch == quote:
            return "".join(chars), i + 1
        else:
            chars.append(ch)
            i += 1
    raise _fail(text, n, f"closing {quote} (opened at position {pos})")
