"""The hub's inverted index agrees with the brute-force selector semantics (pure, no NATS)."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from reach_mesh.hub.index import AgentIndex
from reach_mesh.selector import Selector

Registry = dict[str, tuple[frozenset[str], dict[str, str]]]


def _brute(registry: Registry, sel: Selector) -> set[str]:
    return {a for a, (caps, labels) in registry.items() if sel.matches(caps, labels)}


def _index(registry: Mapping[str, tuple[frozenset[str], dict[str, str]]]) -> AgentIndex:
    index = AgentIndex()
    for agent_id, (caps, labels) in registry.items():
        index.upsert(agent_id, caps, labels)
    return index


REGISTRY: Registry = {
    "ns.mail.a1": (
        frozenset({"email:send:v1"}),
        {"region": "cn-east", "mem_gb": "16", "gpu": "true"},
    ),
    "ns.mail.a2": (frozenset({"email:send:v1"}), {"region": "cn-east", "mem": "4GiB"}),
    "ns.mail.b1": (
        frozenset({"email:send:v1", "email:read:v1"}),
        {"region": "us-west", "mem_gb": "64", "tier": "free"},
    ),
    "ns.data.q1": (frozenset({"data:query:v2"}), {"region": "cn-east", "cpu": "8"}),
}


def test_candidates_basic() -> None:
    index = _index(REGISTRY)
    cases = {
        "cap=email:send:v1": {"ns.mail.a1", "ns.mail.a2", "ns.mail.b1"},
        "cap=email:send:v1 AND region=cn-east": {"ns.mail.a1", "ns.mail.a2"},
        "cap=email:send:v1 AND mem_gte=8GiB": {"ns.mail.a1", "ns.mail.b1"},
        "mem_lt=8GiB": {"ns.mail.a2"},
        "mem exists": {"ns.mail.a1", "ns.mail.a2", "ns.mail.b1"},
        "gpu exists AND mem_gte=8GiB AND region=cn-east": {"ns.mail.a1"},
        "tier!=free": {"ns.mail.a1", "ns.mail.a2", "ns.data.q1"},
        "gpu !exists AND cap!=data:query:v2": {"ns.mail.a2", "ns.mail.b1"},
        "cap=nope:nope:v1": set(),
        "cpu_gt=4 AND cpu_lte=8": {"ns.data.q1"},
    }
    for text, expected in cases.items():
        sel = Selector.parse(text)
        assert index.candidates(sel) == expected, text
        assert _brute(REGISTRY, sel) == expected, text


def test_upsert_replaces_without_ghosts_and_remove() -> None:
    index = _index(REGISTRY)
    index.upsert("ns.mail.a1", ["email:read:v1"], {"region": "eu", "mem_gb": "2"})
    assert index.candidates(Selector.parse("cap=email:send:v1 AND region=cn-east")) == {
        "ns.mail.a2"
    }
    assert "ns.mail.a1" not in index.candidates(Selector.parse("gpu exists"))
    assert "ns.mail.a1" not in index.candidates(Selector.parse("mem_gte=8GiB"))
    assert "ns.mail.a1" in index.candidates(Selector.parse("mem_lte=2GiB"))
    index.remove("ns.mail.a1")
    index.remove("ns.mail.a1")  # idempotent
    assert "ns.mail.a1" not in index
    assert len(index) == 3
    assert index.by_capability("email:read:v1") == {"ns.mail.b1"}
    for text in ("region=eu", "mem_lte=2GiB", "gpu exists"):
        assert index.candidates(Selector.parse(text)) == set()
    for agent_id in list(REGISTRY):
        index.remove(agent_id)
    assert len(index) == 0
    assert index.capability_names() == set()
    # Internal maps are emptied too (no ghost buckets left behind).
    assert not index._by_cap and not index._by_value and not index._by_key
    assert not index._quantities


def test_candidates_returns_a_fresh_set() -> None:
    index = _index(REGISTRY)
    result = index.candidates(Selector.parse("cap=email:send:v1"))
    result.clear()
    assert len(index.by_capability("email:send:v1")) == 3
    assert index.candidates(Selector.parse("tier !exists")) == {
        "ns.mail.a1",
        "ns.mail.a2",
        "ns.data.q1",
    }


def test_by_capability_and_names() -> None:
    index = _index(REGISTRY)
    assert index.by_capability("email:read:v1") == frozenset({"ns.mail.b1"})
    assert index.by_capability("none:none:v1") == frozenset()
    assert index.capability_names() == {"email:send:v1", "email:read:v1", "data:query:v2"}
    assert index.label_values("region") == {"cn-east", "us-west"}
    assert set(index) == set(REGISTRY)


def test_nearest() -> None:
    index = _index(REGISTRY)
    near = index.nearest(Selector.parse("cap=email:send:v1 AND region=cn_east AND gpu exists"))
    assert near.partial == [("ns.mail.a1", "region=cn_east")]
    assert near.similar_values == {"region": ["cn-east"]}
    assert near.similar_capabilities == []

    near = index.nearest(Selector.parse("cap=email:sned:v1"))
    assert near.similar_capabilities[0] == "email:send:v1"
    assert near.partial == []  # single-term selectors have no "all but one"

    near = index.nearest(Selector.parse("cap=email:send:v1 AND mem_gte=32GiB"), limit=1)
    assert len(near.partial) == 1
    assert near.partial[0][1] == "mem_gte=32GiB"

    assert not index.nearest(Selector.parse("zzz=1"))


def test_nearest_suggests_keys_agents_have_for_a_misspelled_one() -> None:
    index = _index(REGISTRY)
    near = index.nearest(Selector.parse("cap=email:send:v1 AND regin=cn-east"))
    assert near.similar_keys == {"regin": ["region"]}
    # A comparison's key is compared with the keys that hold quantities only.
    assert index.nearest(Selector.parse("mme_gte=8GiB")).similar_keys == {"mme": ["mem"]}
    # "capability=<a capability>" means cap=...
    near = index.nearest(Selector.parse("capability=email:send:v1"))
    assert near.similar_keys == {"capability": ["cap"]}
    # A key some agent has, a negative term, a key like nothing: no suggestion.
    for text in ("region=mars", "regin!=cn-east", "regin !exists", "zzz=1"):
        assert index.nearest(Selector.parse(text)).similar_keys == {}, text
    # Within a namespace: only the keys its agents have.
    other = _index({"other.x.y": (frozenset({"a:b:v1"}), {"zone": "z1"})})
    assert other.nearest(Selector.parse("zome=z1"), namespace="other").similar_keys == {
        "zome": ["zone"]
    }
    assert other.nearest(Selector.parse("zome=z1"), namespace="ns").similar_keys == {}


# -- equivalence with the brute force ----------------------------------------------------------

_CAPS = ["email:send:v1", "email:read:v1", "data:query:v2", "img:gen:v1"]
_LABEL_KEYS = ["region", "tier", "gpu", "mem", "mem_gb", "mem_mb", "cpu", "disk_tb", "n"]
_LABEL_VALUES = [
    "cn-east",
    "cn_east",
    "free",
    "true",
    "",
    "0",
    "1",
    "4",
    "8",
    "16",
    "-1",
    "0.5",
    "4GiB",
    "16GiB",
    "8GB",
    "512MiB",
    "a b",
]
_AGENT_IDS = [f"ns.svc.a{i}" for i in range(12)]

_labels = st.dictionaries(st.sampled_from(_LABEL_KEYS), st.sampled_from(_LABEL_VALUES), max_size=6)
_agent = st.tuples(st.frozensets(st.sampled_from(_CAPS), max_size=3), _labels)


@st.composite
def _selector_text(draw: st.DrawFn) -> str:
    terms: list[str] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["cap", "eq", "ne", "exists", "nexists", "cmp"]))
        key = draw(st.sampled_from([*_LABEL_KEYS, "disk", "missing"]))
        value = draw(st.sampled_from(_LABEL_VALUES))
        quoted = '"' + value + '"'
        if kind == "cap":
            op = draw(st.sampled_from(["=", "!="]))
            terms.append(f"cap{op}{draw(st.sampled_from([*_CAPS, 'no:such:v1']))}")
        elif kind == "eq":
            terms.append(f"{key}={quoted}")
        elif kind == "ne":
            terms.append(f"{key}!={quoted}")
        elif kind == "exists":
            terms.append(f"{key} exists")
        elif kind == "nexists":
            terms.append(f"{key} !exists")
        else:
            suffix = draw(st.sampled_from(["gte", "lte", "gt", "lt"]))
            bound = draw(st.sampled_from(["0", "1", "4", "8", "16", "4GiB", "8GiB", "1TiB"]))
            terms.append(f"{key}_{suffix}={bound}")
    return " AND ".join(terms)


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("upsert"), st.sampled_from(_AGENT_IDS), _agent),
        st.tuples(st.just("remove"), st.sampled_from(_AGENT_IDS), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.lists(_selector_text(), min_size=1, max_size=6))
def test_index_equals_brute_force(
    ops: list[tuple[str, str, tuple[frozenset[str], dict[str, str]] | None]],
    selectors: list[str],
) -> None:
    index = AgentIndex()
    registry: Registry = {}
    for op, agent_id, agent in ops:
        if op == "upsert":
            assert agent is not None
            index.upsert(agent_id, agent[0], agent[1])
            registry[agent_id] = agent
        else:
            index.remove(agent_id)
            registry.pop(agent_id, None)
    assert len(index) == len(registry)
    assert set(index) == set(registry)
    for text in selectors:
        sel = Selector.parse(text)
        expected = _brute(registry, sel)
        assert index.candidates(sel) == expected, text
        # nearest() never suggests a full match as a partial one.
        for agent_id, failing in index.nearest(sel).partial:
            assert agent_id not in expected
            assert not Selector.parse(failing).matches(*registry[agent_id])
    # A rebuilt index is indistinguishable: nothing stale survived the update sequence.
    fresh = _index(registry)
    assert fresh._by_cap == index._by_cap
    assert fresh._by_value == index._by_value
    assert fresh._by_key == index._by_key
    assert {k: (v.by_min, v.by_max, v.low, v.high) for k, v in fresh._quantities.items()} == {
        k: (v.by_min, v.by_max, v.low, v.high) for k, v in index._quantities.items()
    }


def test_matches_ids_follow_a_slot_given_to_another_agent() -> None:
    """The same bitmap names other agents once a freed slot is taken again: the ids a
    ``Matches`` listed before (kept by bitmap for the next route) are not handed out then."""
    index = AgentIndex()
    index.upsert("ns.w.a", ["c"], {})
    index.upsert("ns.w.b", ["c"], {})
    assert list(index.capable("c", "ns")) == ["ns.w.a", "ns.w.b"]
    assert index.capable("c", "ns").ids() is index.capable("c", "ns").ids()  # kept
    index.remove("ns.w.a")
    index.upsert("ns.w.z", ["c"], {})  # slot 0 again: the same bitmap as before
    assert list(index.capable("c", "ns")) == ["ns.w.z", "ns.w.b"]
    index.remove("ns.w.b")
    index.remove("ns.w.z")
    index.upsert("ns.w.y", ["c"], {})
    assert list(index.capable("c", "ns")) == ["ns.w.y"]
