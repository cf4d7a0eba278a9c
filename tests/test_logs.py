"""Structured logging: formatters, log_event, configure_logging."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from reach_mesh import logs
from reach_mesh.logs import (
    LEASE_EXPIRED,
    QUARANTINE,
    ROUTE_LATENCY,
    SELECT_EMPTY,
    HumanFormatter,
    JsonFormatter,
    LineBudget,
    configure_logging,
    get_logger,
    log_event,
)
from reach_mesh.tracing import SpanKind, span, trace_id_from_headers


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, _ListHandler]]:
    logger = get_logger("reach_mesh.tests.logs")
    handler = _ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield logger, handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


@pytest.fixture
def restore_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_all_matches_public_names() -> None:
    public = {
        name
        for name, value in vars(logs).items()
        if not name.startswith("_")
        and getattr(value, "__module__", logs.__name__) == logs.__name__
        and name != "annotations"
        and not isinstance(value, type(logs))
    }
    assert set(logs.__all__) == public


def test_keywords() -> None:
    assert (SELECT_EMPTY, LEASE_EXPIRED, QUARANTINE, ROUTE_LATENCY) == (
        "REACH-SELECT-EMPTY",
        "REACH-LEASE-EXPIRED",
        "REACH-QUARANTINE",
        "REACH-ROUTE-LATENCY",
    )


def test_get_logger_nests_under_the_package() -> None:
    assert get_logger("reach_mesh.hub.router").name == "reach_mesh.hub.router"
    assert get_logger("reach_mesh").name == "reach_mesh"
    assert get_logger("myapp").name == "reach_mesh.myapp"


def test_log_event_fields_and_default_level(
    captured: tuple[logging.Logger, _ListHandler],
) -> None:
    logger, handler = captured
    log_event(logger, SELECT_EMPTY, "no candidate", agent_id="fin.q.a1", request_id="r1")
    log_event(logger, ROUTE_LATENCY, "slow route", ms=12.5)
    log_event(logger, "CUSTOM", "debug only", level=logging.DEBUG)
    empty, slow, custom = handler.records
    assert empty.levelno == logging.WARNING
    assert (empty.event, empty.agent_id, empty.request_id) == (  # type: ignore[attr-defined]
        SELECT_EMPTY,
        "fin.q.a1",
        "r1",
    )
    assert slow.levelno == logging.INFO and slow.ms == 12.5  # type: ignore[attr-defined]
    assert custom.levelno == logging.DEBUG
    assert empty.funcName == "test_log_event_fields_and_default_level"  # the caller, not us
    assert not hasattr(empty, "trace_id")  # outside a trace


def test_log_event_adds_the_current_trace_id(
    captured: tuple[logging.Logger, _ListHandler],
) -> None:
    logger, handler = captured
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with span("reach.handle", kind=SpanKind.CONSUMER, parent_headers=headers):
        log_event(logger, QUARANTINE, "breaker open")
        log_event(logger, QUARANTINE, "explicit", trace_id="given")
    implicit, explicit = handler.records
    assert implicit.trace_id == trace_id_from_headers(headers)  # type: ignore[attr-defined]
    assert explicit.trace_id == "given"  # type: ignore[attr-defined]


def test_log_event_renames_reserved_fields(
    captured: tuple[logging.Logger, _ListHandler],
) -> None:
    logger, handler = captured
    log_event(logger, LEASE_EXPIRED, "lease gone", name="x", msg="y", args=1)
    (record,) = handler.records
    assert record.getMessage() == "lease gone"
    assert (record.name_, record.msg_, record.args_) == ("x", "y", 1)  # type: ignore[attr-defined]


def test_log_event_is_free_when_disabled(captured: tuple[logging.Logger, _ListHandler]) -> None:
    logger, handler = captured
    logger.setLevel(logging.ERROR)

    class Explodes:
        def __str__(self) -> str:
            raise AssertionError("formatted although the level is disabled")

    log_event(logger, ROUTE_LATENCY, "slow", value=Explodes())
    assert handler.records == []


def test_json_formatter(captured: tuple[logging.Logger, _ListHandler]) -> None:
    logger, handler = captured
    log_event(logger, QUARANTINE, "breaker %s", agent_id="a", when=object())
    try:
        raise ValueError("bad")
    except ValueError:
        logger.exception("failed %d", 3, extra={"agent_id": "b", "level": "clash"})
    lines = [JsonFormatter().format(r) for r in handler.records]
    assert all("\n" not in line for line in lines)
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING"
    assert first["logger"] == "reach_mesh.tests.logs"
    assert first["msg"] == "breaker %s"
    assert first["event"] == QUARANTINE
    assert first["agent_id"] == "a"
    assert first["when"].startswith("<object")  # unencodable values become str()
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert second["msg"] == "failed 3"
    assert second["level"] == "ERROR" and second["level_"] == "clash"
    assert "ValueError: bad" in second["exc"]


def test_human_formatter(captured: tuple[logging.Logger, _ListHandler]) -> None:
    logger, handler = captured
    log_event(logger, LEASE_EXPIRED, "agent suspect", agent_id="fin.q.a1")
    line = HumanFormatter().format(handler.records[0])
    assert "WARNING" in line
    assert "[REACH-LEASE-EXPIRED] agent suspect" in line
    assert line.endswith("agent_id=fin.q.a1")


def test_configure_logging(restore_root: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()  # not a TTY: JSON by default
    monkeypatch.setattr(sys, "stderr", stream)
    configure_logging("debug")
    configure_logging("info")  # replaces its own handler instead of adding a second
    ours = [h for h in restore_root.handlers if isinstance(h, logs._ReachHandler)]
    assert len(ours) == 1
    assert isinstance(ours[0].formatter, JsonFormatter)
    assert restore_root.level == logging.INFO
    log_event(get_logger("reach_mesh.hub"), SELECT_EMPTY, "nothing", agent_id="x")
    entry = json.loads(stream.getvalue().strip().splitlines()[-1])
    assert (entry["event"], entry["agent_id"]) == (SELECT_EMPTY, "x")

    configure_logging(logging.WARNING, json=False)
    ours = [h for h in restore_root.handlers if isinstance(h, logs._ReachHandler)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, HumanFormatter)
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging("loud")


def test_line_budget_holds_back_and_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("reach_mesh.logs.time.monotonic", lambda: now[0])
    budget = LineBudget(10.0, max_keys=2)
    assert budget.take("a") == 0  # the first line is due
    assert budget.take("a") is None and budget.take("a") is None  # held back, counted
    assert budget.take("b") == 0  # keys are independent
    now[0] += 10.0
    assert budget.take("a") == 2  # due again, telling how many were held back
    assert budget.take("c") == 0  # past max_keys: it starts over, never silent for long
    assert budget.take("a") == 0


def test_line_budget_warns_with_the_count_only_when_lines_were_held_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's first refusal line said "(0 such lines held back)": noise, read as a
    count that matters."""
    now = [100.0]
    monkeypatch.setattr("reach_mesh.logs.time.monotonic", lambda: now[0])
    budget = LineBudget(10.0)
    logger = logging.getLogger("reach_mesh.test_budget")
    with caplog.at_level(logging.WARNING, logger="reach_mesh.test_budget"):
        for _ in range(3):
            budget.warn(logger, "k", "refused %s", "x")
        now[0] += 10.0
        budget.warn(logger, "k", "refused %s", "x")
        now[0] += 10.0
        budget.warn(logger, "k", "refused %s", "x")
    said = [r.getMessage() for r in caplog.records if r.name == "reach_mesh.test_budget"]
    assert said == ["refused x", "refused x (2 such lines held back)", "refused x"]


def test_line_budget_bounds_lines_of_new_keys_too(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("reach_mesh.logs.time.monotonic", lambda: now[0])
    budget = LineBudget(10.0, max_lines=3)
    assert [budget.take(k) for k in range(5)] == [0, 0, 0, None, None]  # a new key each
    assert budget.take(10**6) is None and len(budget._held) == 0  # unseen keys are not kept
    now[0] += 10.0
    assert budget.take(3) == 3  # the next interval: due again, with what was held back
