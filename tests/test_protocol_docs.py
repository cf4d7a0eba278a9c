"""The wire-protocol docs agree with the code: subjects, error codes, labelled examples.

Convention: a JSON example preceded by ``<!-- model: Name -->`` must validate against the
pydantic model ``Name`` of ``reach_mesh.models`` or ``reach_mesh.workflow``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from reach_mesh import errors, models, protocol, schemas, workflow

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROTOCOL = (DOCS / "protocol.md").read_text()
WORKFLOWS = (DOCS / "protocol-workflows.md").read_text()

_NS, _AGENT, _TASK, _WF = "ns", "ns.svc.inst", "t1", "wf1"
_PLACEHOLDERS = {
    "<ns>": _NS,
    "<service>": "svc",
    "<instance>": "inst",
    "<agent_id>": _AGENT,
    "<task_id>": _TASK,
    "<workflow_id>": _WF,
    "<kind>": "route",
    "<hub_id>": "hub1",
}

# Every subject the code builds, with the placeholders above filled in.
BUILT = {
    *(protocol.hub_agent_subject(_AGENT, verb) for verb in protocol.AGENT_VERBS),
    *(
        protocol.hub_subject(_NS, verb)
        for verb in (
            "route",
            "route_batch",
            "report",
            "agents",
            "workflow",
            "workflows",
            "cancel",
            "admin",
        )
    ),
    protocol.hub_broadcast(_NS, "breaker"),
    protocol.hub_broadcast(_NS, "pins"),
    protocol.hub_broadcast(_NS, "pins_ask"),
    protocol.hub_broadcast(_NS, "pin_of"),
    protocol.hub_peer(_NS, "workflow", "hub1"),
    protocol.hub_peer(_NS, "cancel", "hub1"),
    protocol.agent_task(_AGENT),
    protocol.agent_batch(_AGENT),
    protocol.agent_ctl(_AGENT),
    protocol.task_status(_AGENT, _TASK),
    protocol.work_subject(_NS, _AGENT),
    protocol.wf_submit(_NS),
    protocol.wf_event(_NS, _WF),
    protocol.wf_done(_NS, _WF),
    protocol.audit_subject(_NS, "route"),
    protocol.micro_subject("hub1", "agents"),
}


def _table_subjects(doc: str) -> list[str]:
    """The backticked subjects in the first column of the doc's ``## Subjects`` table."""
    section = doc.split("\n## Subjects\n", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        if line.startswith("| `reach."):
            first_cell = line.split("|")[1]
            found += re.findall(r"`(reach\.[^`]+)`", first_cell)
    return found


def _fill(pattern: str) -> str:
    for key, value in _PLACEHOLDERS.items():
        pattern = pattern.replace(key, value)
    return pattern


@pytest.mark.parametrize("doc", [PROTOCOL, WORKFLOWS], ids=["protocol", "workflows"])
def test_subject_tables_match_protocol_builders(doc: str) -> None:
    subjects = _table_subjects(doc)
    assert len(subjects) >= 6
    for pattern in subjects:
        assert "<" not in _fill(pattern), f"unknown placeholder in {pattern}"
        assert _fill(pattern) in BUILT, f"{pattern} is not a subject reach_mesh.protocol builds"


def test_protocol_table_covers_every_built_subject() -> None:
    documented = {_fill(p) for p in _table_subjects(PROTOCOL)}
    assert BUILT - documented == set()


def test_every_error_code_is_in_the_error_table() -> None:
    table = PROTOCOL.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(REACH_[A-Z_]+)` \|", table, re.M))
    codes = {
        cls.code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.ReachError)
    } - {errors.ReachError.code}
    assert codes, "no error classes found"
    assert codes - documented == set(), "codes missing from docs/protocol.md's error table"
    assert documented - codes == set(), "documented codes that reach_mesh.errors lacks"


_LABELLED = re.compile(r"<!-- model: (\w+) -->\n```json\n(.*?)\n```", re.S)


def _examples() -> list[tuple[str, str, str]]:
    out = []
    for name, doc in (("protocol.md", PROTOCOL), ("protocol-workflows.md", WORKFLOWS)):
        out += [(name, model, body) for model, body in _LABELLED.findall(doc)]
    return out


def test_enough_examples_are_labelled() -> None:
    assert {model for _, model, _ in _examples()} >= {
        "RegisterRequest",
        "RouteRequest",
        "RouteReply",
        "TaskEnvelope",
        "TaskReply",
    }


@pytest.mark.parametrize(
    ("doc", "model_name", "body"), _examples(), ids=lambda v: v if "\n" not in v else ""
)
def test_labelled_example_validates(doc: str, model_name: str, body: str) -> None:
    model = getattr(models, model_name, None) or getattr(workflow, model_name)
    assert isinstance(model, type) and issubclass(model, BaseModel)
    data = json.loads(body)
    model.model_validate(data)
    # A success example is never an error body (the error-body rule).
    protocol.raise_for_error(json.dumps(data).encode())


def test_message_ids_carry_the_namespace_and_name_the_workflow() -> None:
    """Every ``Nats-Msg-Id`` starts with the namespace (JetStream deduplicates per stream; ids
    are unique per namespace), a submission's ends with its random nonce, and a hub reads the
    workflow id from a submission's, in the forms earlier clients sent too (workflow ids,
    namespaces and nonces have no dots)."""
    ids = [
        protocol.submit_msg_id("ns-a", "wf_1", "n0nce"),
        protocol.attempt_msg_id("ns-a", "wf_1-0", 2),
        protocol.fence_msg_id("ns-a", "wf_1-0", 2),
        protocol.final_msg_id("ns-a", "wf_1-0", 2, "n0nce"),
    ]
    assert ids == [
        "ns-a.wf_1.n0nce",
        "ns-a.wf_1-0#2",
        "ns-a.wf_1-0#2.fence",
        "ns-a.wf_1-0#2.final.n0nce",
    ]
    assert protocol.submit_msg_id("ns-a", "x", "n") != protocol.submit_msg_id("ns-b", "x", "n")
    for msg_id in (protocol.submit_msg_id("ns-a", "Wf-1_x", "n0nce"), "ns-a.Wf-1_x", "Wf-1_x"):
        assert protocol.workflow_id_of(msg_id) == "Wf-1_x"


def _shape(schema: dict[str, Any]) -> dict[str, Any]:
    """What a reader in another language relies on in a model's schema: its fields, which are
    required, and the JSON types (``null`` included) each one takes — not the wording, which
    another pydantic version may change."""

    def types(prop: dict[str, Any]) -> list[str]:
        alts = prop.get("anyOf") or prop.get("oneOf") or [prop]
        out = set()
        for alt in alts:
            out.add(alt.get("type") or alt.get("$ref") or ("enum" if "enum" in alt else "any"))
        return sorted(out)

    if "properties" not in schema:
        return {"enum": sorted(map(str, schema.get("enum", [])))}
    return {
        "required": sorted(schema.get("required", [])),
        "fields": {name: types(prop) for name, prop in schema["properties"].items()},
    }


def test_protocol_schemas_file_is_the_models() -> None:
    """``docs/protocol-schemas.json`` is what ``python -m reach_mesh.schemas`` writes from
    the models: every wire model, each with the fields, required ones and types (nullable or
    not) the models validate. Regenerate it after changing a model."""
    committed = json.loads((DOCS / "protocol-schemas.json").read_text())
    current = schemas.wire_schemas()
    assert sorted(committed["$defs"]) == sorted(current["$defs"]), "regenerate the file"
    for name, schema in current["$defs"].items():
        assert _shape(committed["$defs"][name]) == _shape(schema), f"{name}: regenerate"
    # What the protocol pages name as messages is in it, and the page points readers there.
    for model in ("TaskEnvelope", "TaskReply", "TaskStatusEvent", "RegisterRequest", "Heartbeat"):
        assert model in current["$defs"]
    status = current["$defs"]["TaskStatusEvent"]["properties"]
    assert _shape({"properties": {"d": status["duration_ms"]}})["fields"]["d"] == ["number"]
    assert "protocol-schemas.json" in PROTOCOL


_VECTOR = re.compile(r"^\s*\| `(\{.*?\})` \| `(\{.*?\})` \| `([0-9a-f]{32})` \|$", re.M)


def test_spec_digest_vectors_are_the_hubs() -> None:
    """The test vectors of protocol-workflows.md (what a client in another language checks its
    canonical form against) are what ``spec_digest`` computes: the submitted spec read as the
    hubs read it gives the digest, and the canonical form shown hashes to it."""
    vectors = _VECTOR.findall(WORKFLOWS)
    assert len(vectors) >= 2
    for submitted, canonical, digest in vectors:
        spec = workflow.WorkflowSpec.model_validate_json(submitted)
        assert workflow.spec_digest(spec) == digest, submitted
        assert hashlib.sha256(canonical.encode()).hexdigest()[:32] == digest, canonical
