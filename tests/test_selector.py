"""Selector parsing, canonical form, units and reference semantics (pure, no NATS)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach_mesh.errors import BadRequestError, SelectorError
from reach_mesh.selector import (
    MAX_SELECTOR_LENGTH,
    Selector,
    Term,
    label_quantities,
    parse_quantity,
)

GIB = 2.0**30

# -- parsing -----------------------------------------------------------------------------------


def test_parse_full_example() -> None:
    sel = Selector.parse(
        "cap=email:send:v1 AND region=cn-east AND mem_gte=8GiB AND gpu exists AND tier!=free"
    )
    assert sel.terms == (
        Term("cap", "=", "email:send:v1"),
        Term("region", "=", "cn-east"),
        Term("mem", ">=", "8GiB", 8 * GIB),
        Term("gpu", "exists"),
        Term("tier", "!=", "free"),
    )
    assert [t.position for t in sel.terms] == [0, 22, 41, 58, 73]
    assert sel.capabilities == ("email:send:v1",)


@pytest.mark.parametrize(
    ("text", "term"),
    [
        ("a=b", Term("a", "=", "b")),
        ("a != b", Term("a", "!=", "b")),
        ("  a =   b  ", Term("a", "=", "b")),
        ("gpu exists", Term("gpu", "exists")),
        ("gpu EXISTS", Term("gpu", "exists")),
        ("gpu !exists", Term("gpu", "!exists")),
        ("gpu!exists", Term("gpu", "!exists")),
        ("cpu_gt=4", Term("cpu", ">", "4", 4.0)),
        ("cpu_lt=-1.5", Term("cpu", "<", "-1.5", -1.5)),
        ("disk_lte=500GB", Term("disk", "<=", "500GB", 500e9)),
        ("mem_gte='8 GiB'", Term("mem", ">=", "8 GiB", 8 * GIB)),
        ("x_gt_gte=1", Term("x_gt", ">=", "1", 1.0)),
        ('name="hello world"', Term("name", "=", "hello world")),
        ("name='it''s'", None),  # adjacent quoted strings are not concatenated
        (r'q="say \"hi\""', Term("q", "=", 'say "hi"')),
        ('e=""', Term("e", "=", "")),
        ("k.v-1_x=AND", Term("k.v-1_x", "=", "AND")),
        ("cap!=email:send:v1", Term("cap", "!=", "email:send:v1")),
        ("mem_gte exists", Term("mem_gte", "exists")),
    ],
)
def test_parse_single_terms(text: str, term: Term | None) -> None:
    if term is None:
        with pytest.raises(SelectorError):
            Selector.parse(text)
        return
    assert Selector.parse(text).terms == (term,)


def test_and_is_case_insensitive_and_whitespace_flexible() -> None:
    sel = Selector.parse("a=1 and b=2\tAnD\nc exists")
    assert [t.key for t in sel.terms] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("text", "position", "expected_fragment"),
    [
        ("", 0, "a term"),
        ("   ", 3, "a term"),
        ("a=b AND", 7, "a term"),
        ("a=b AND ", 8, "a term"),
        ("a=b OR c=d", 4, "'AND'"),
        ("a=b && c=d", 4, "'AND'"),
        ("a=b ANDc=d", 4, "'AND'"),
        ("Region=x", 0, "a term"),
        ("a", 1, "'='"),
        ("a ~ b", 2, "'='"),
        ("a=", 2, "a value"),
        ('a="x', 4, "closing"),
        ("mem_gte=lots", 8, "a number"),
        ("mem_gte=8 GiB", 10, "'AND'"),
        ("mem_gte=8XB", 8, "a number"),
        ("mem_gte=nan", 8, "a number"),
        ("mem_gte=1e999", 8, "a number"),
        ("mem_gte!=8", 7, "'='"),
        ("cap=email", 4, "capability"),
        ("cap=Email:send:v1", 4, "capability"),
        ("cap exists", 4, "'=' or '!='"),
        ("cap_gte=1", 0, "comparison"),
        ("gpu existsx", 4, "'='"),
        # The two mistakes a newcomer makes most: the error names the fix.
        ("Region=eu-west", 0, "keys are lower case: 'region'"),
        ("cap=a:b:v1 AND Gpu=true", 15, "keys are lower case: 'gpu'"),
        ("cap=a:b:v1 OR region=eu", 11, "no OR"),
        ("region=eu or gpu=true", 10, "no OR"),
    ],
)
def test_errors_name_position_and_expectation(
    text: str, position: int, expected_fragment: str
) -> None:
    with pytest.raises(SelectorError) as info:
        Selector.parse(text)
    err = info.value
    assert err.details["position"] == position
    assert expected_fragment in err.details["expected"]
    assert f"position {position}" in err.message
    assert isinstance(err, BadRequestError)
    assert err.code == "REACH_BAD_SELECTOR"


_COLON_HINT = "(labels are tested as key=value, capabilities as cap=domain:action:vN)"


@pytest.mark.parametrize(
    ("text", "position", "hint"),
    [
        # `--selector shop:price:v1`, meant as `--capability`: the term it takes is named.
        ("shop:price:v1", 4, "(a capability is tested as cap=shop:price:v1)"),
        (
            "cap=a:b:v1 AND email:send:v2 AND x=1",
            20,
            "(a capability is tested as cap=email:send:v2)",
        ),
        ("region:eu-west", 6, _COLON_HINT),
        ("shop:price", 4, _COLON_HINT),
    ],
)
def test_a_term_written_with_a_colon_says_how_it_is_written(
    text: str, position: int, hint: str
) -> None:
    with pytest.raises(SelectorError) as info:
        Selector.parse(text)
    assert info.value.details["position"] == position
    assert info.value.message.endswith(hint), info.value.message
    assert info.value.details["expected"] == "'=', '!=', 'exists' or '!exists'"


def test_a_term_without_an_operator_and_no_colon_gets_no_guess() -> None:
    with pytest.raises(SelectorError) as info:
        Selector.parse("gpu true")
    assert info.value.message.endswith("found 'true'"), info.value.message


def test_length_limit() -> None:
    ok = "a=" + "x" * (MAX_SELECTOR_LENGTH - 2)
    assert Selector.parse(ok).terms[0].value == "x" * (MAX_SELECTOR_LENGTH - 2)
    with pytest.raises(SelectorError) as info:
        Selector.parse(ok + "x")
    assert info.value.details["position"] == MAX_SELECTOR_LENGTH


def test_canonical_form() -> None:
    sel = Selector.parse("  cap = email:send:v1 and mem_gte = '8GiB'  AND  n='a b' AND g !exists")
    assert str(sel) == 'cap=email:send:v1 AND mem_gte=8GiB AND n="a b" AND g !exists'
    assert Selector.parse(str(sel)) == sel


# -- quantities --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", 8.0),
        ("-3", -3.0),
        ("0.5", 0.5),
        (".5", 0.5),
        ("2e3", 2000.0),
        ("8GiB", 8 * GIB),
        ("8gib", 8 * GIB),
        ("8 GiB", 8 * GIB),
        ("1KiB", 1024.0),
        ("1MiB", 2.0**20),
        ("1TiB", 2.0**40),
        ("1KB", 1e3),
        ("1mb", 1e6),
        ("1GB", 1e9),
        ("1TB", 1e12),
        ("512B", 512.0),
        ("1.5GiB", 1.5 * GIB),
        ("", None),
        ("GiB", None),
        ("8 apples", None),
        ("nan", None),
        ("inf", None),
        ("1e999", None),
        ("٣", None),  # non-ASCII digits are not numbers here
        ("1_000", None),
        ("true", None),
    ],
)
def test_parse_quantity(text: str, value: float | None) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("cpu", "8", [("cpu", 8.0)]),
        ("mem", "16GiB", [("mem", 16 * GIB)]),
        ("disk", "500GB", [("disk", 500e9)]),
        ("mem_gb", "16", [("mem_gb", 16.0), ("mem", 16 * GIB)]),  # key suffixes are binary
        ("mem_gib", "16", [("mem_gib", 16.0), ("mem", 16 * GIB)]),
        ("mem_mb", "512", [("mem_mb", 512.0), ("mem", 512 * 2.0**20)]),
        ("disk_tb", "2", [("disk_tb", 2.0), ("disk", 2 * 2.0**40)]),
        ("blob_kb", "1", [("blob_kb", 1.0), ("blob", 1024.0)]),
        ("size_b", "10", [("size_b", 10.0), ("size", 10.0)]),
        ("mem_gb", "16GiB", [("mem_gb", 16.0), ("mem", 16 * GIB)]),
        ("region", "cn-east", []),
        ("mem_gb", "lots", []),
        ("gpu", "true", []),
    ],
)
def test_label_quantities(key: str, value: str, expected: list[tuple[str, float]]) -> None:
    assert label_quantities(key, value) == expected


# -- semantics ---------------------------------------------------------------------------------

AGENT_CAPS = {"email:send:v1", "data:query:v2"}
AGENT_LABELS = {"region": "cn-east", "mem_gb": "16", "gpu": "true", "cpu": "8", "tier": "pro"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cap=email:send:v1", True),
        ("cap=email:send:v2", False),
        ("cap!=email:send:v2", True),
        ("cap!=email:send:v1", False),
        ("region=cn-east", True),
        ("region=cn_east", False),
        ("region!=cn-east", False),
        ("tier!=free", True),
        ("missing!=x", True),  # absent labels are "not equal"
        ("gpu exists", True),
        ("mem exists", True),  # derived from mem_gb
        ("mem_gb exists", True),
        ("missing exists", False),
        ("missing !exists", True),
        ("mem !exists", False),
        ("mem_gte=8GiB", True),
        ("mem_gte=16GiB", True),
        ("mem_gt=16GiB", False),
        ("mem_lt=17GiB", True),
        ("mem_gb_gte=16", True),
        ("mem_gte=8GB", True),
        ("mem_gte=20GB", False),  # 16 GiB ≈ 17.18 GB
        ("cpu_gt=4", True),
        ("cpu_lte=4", False),
        ("region_gte=1", False),  # non-numeric labels never compare
        ("nokey_lt=1", False),
        (
            "cap=email:send:v1 AND region=cn-east AND mem_gte=8GiB AND gpu exists AND tier!=free",
            True,
        ),
        ("cap=email:send:v1 AND region=us-west", False),
    ],
)
def test_matches(text: str, expected: bool) -> None:
    assert Selector.parse(text).matches(AGENT_CAPS, AGENT_LABELS) is expected


def test_any_quantity_of_a_key_may_satisfy_a_comparison() -> None:
    labels = {"mem": "4GiB", "mem_gb": "32"}  # two sources for "mem"
    assert Selector.parse("mem_gte=16GiB").matches((), labels)
    assert Selector.parse("mem_lte=8GiB").matches((), labels)
    assert not Selector.parse("mem_gt=32GiB").matches((), labels)


def test_equality_uses_raw_label_text() -> None:
    assert not Selector.parse("mem_gb=16.0").matches((), {"mem_gb": "16"})
    assert Selector.parse("mem_gb_gte=16.0").matches((), {"mem_gb": "16"})


# -- properties --------------------------------------------------------------------------------

_KEYS = st.sampled_from(["a", "b", "region", "mem", "mem_gb", "x.y-z", "k_gt", "cap"])
_VALUES = st.one_of(
    st.sampled_from(["x", "cn-east", "8GiB", "16", "-2.5", "a b", 'q"uote', "it's", "", "\\"]),
    st.text(max_size=8),
)
_CAPS = st.sampled_from(["email:send:v1", "data:query:v2", "a-b:c_d:v10"])


@st.composite
def _terms(draw: st.DrawFn) -> Term:
    kind = draw(st.sampled_from(["eq", "cap", "exists", "cmp"]))
    if kind == "cap":
        return Term("cap", draw(st.sampled_from(["=", "!="])), draw(_CAPS))
    key = draw(_KEYS.filter(lambda k: k != "cap"))
    if kind == "exists":
        return Term(key, draw(st.sampled_from(["exists", "!exists"])))
    if kind == "eq":
        # ``k_gt=…`` reads as a comparison on ``k``; such keys can only be tested with exists.
        key = "k" if key == "k_gt" else key
        return Term(key, draw(st.sampled_from(["=", "!="])), draw(_VALUES))
    raw = draw(st.sampled_from(["8GiB", "16", "-1", "0.5", "2e3", "1 KB"]))
    number = parse_quantity(raw)
    return Term(key, draw(st.sampled_from([">=", "<=", ">", "<"])), raw, number)


@settings(max_examples=200, deadline=None)
@given(st.lists(_terms(), min_size=1, max_size=5))
def test_canonical_round_trip(terms: list[Term]) -> None:
    sel = Selector(tuple(terms))
    text = str(sel)
    reparsed = Selector.parse(text)
    assert reparsed == sel
    assert str(reparsed) == text


_SELECTOR_ALPHABET = st.sampled_from([*"ab=!_ \t'\"\\:.-8GiBANDexists", "AND", "cap"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=60), st.lists(_SELECTOR_ALPHABET, max_size=30).map("".join)))
def test_parser_only_raises_selector_error(text: str) -> None:
    try:
        sel = Selector.parse(text)
    except SelectorError as err:
        assert isinstance(err.details["position"], int)
        assert 0 <= err.details["position"] <= len(text)
        assert err.details["expected"]
    else:
        assert sel.terms
        assert Selector.parse(str(sel)) == sel


def test_a_long_quantity_is_refused_in_linear_time() -> None:
    """Two runs of optional spaces side by side once made a long run of spaces quadratic (45 ms
    for 4,000; a route batch of them froze the hub's loop for seconds). Refused at once now."""
    import time

    from reach_mesh.selector import parse_quantity

    t0 = time.perf_counter()
    assert parse_quantity("1" + " " * 40_000 + "!") is None
    assert parse_quantity(" " * 40_000 + "8 GiB" + " " * 40_000) == 8 * 2.0**30
    assert time.perf_counter() - t0 < 1.0  # quadratic: several seconds
    with pytest.raises(SelectorError):
        Selector.parse('mem_gte="1' + " " * 3000 + '!"')


def test_a_selector_has_at_most_32_terms() -> None:
    ok = " AND ".join(f"k{i}=v" for i in range(32))
    assert len(Selector.parse(ok).terms) == 32
    with pytest.raises(SelectorError) as err:
        Selector.parse(ok + " AND k32=v")
    assert "at most 32 terms" in err.value.message
    assert err.value.details["position"] == len(ok) + len(" AND ")
