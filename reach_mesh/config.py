"""One frozen settings object for every reach-mesh process.

Built in code (tests), from a YAML file, and from ``REACH_*`` environment variables, in that
order of precedence (lowest first): defaults < YAML < environment < explicit keyword overrides.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from reach_mesh.errors import BadRequestError
from reach_mesh.models import lease_error

__all__ = ["MeshSettings", "load_settings"]

ENV_PREFIX: Final = "REACH_"


class MeshSettings(BaseModel):
    """Settings shared by hub, agent and client. Times are float seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: NATS URL(s), comma separated. ``None``: ``reach-mesh up`` starts an embedded server.
    nats_url: str | None = None
    #: NATS credentials: a ``.creds`` file (JWT + nkey), or a token. A user and password can be
    #: given in the URL (``nats://user:pass@host:4222``).
    nats_creds: str | None = None
    nats_token: str | None = Field(default=None, repr=False)
    #: Secure mode (docs/security.md): a file holding this identity's nkey seed (``SU…``), as
    #: ``reach-mesh auth`` writes it, and the private prefix of its reply subjects
    #: (``_INBOX.<role>.<name>``: the server lets no other identity subscribe there).
    nats_nkey_seed: str | None = None
    #: ``_INBOX`` or under ``_INBOX.``: hubs and agents answer nowhere else (docs/security.md).
    nats_inbox_prefix: str | None = Field(default=None, pattern=r"^_INBOX(\.[!-)+-\-/-=?-~]+)*$")
    #: TLS: CA bundle to verify the server, and a client certificate/key for mutual TLS.
    #: ``tls://`` URLs use the system CAs when no bundle is given.
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    namespace: str = "default"
    #: Namespaces a hub keeps metrics and audit subjects for even while no agent is registered
    #: in them (besides ``namespace``). Routes to a namespace that is neither configured nor has
    #: a registered agent get ``REACH_UNKNOWN_NAMESPACE`` and leave no trace but a shared count
    #: (namespace ``(unknown)``) and a line now and then (docs/security.md).
    namespaces: tuple[str, ...] = ()

    # liveness
    heartbeat_interval: float = Field(default=5.0, gt=0)
    lease_timeout: float = Field(default=15.0, gt=0)
    suspect_timeout: float = Field(default=30.0, ge=0)
    #: How often a hub re-grades leases (SUSPECT/LOST); small so expiry is prompt.
    liveness_interval: float = Field(default=0.5, gt=0)

    # requests
    request_timeout: float = Field(default=30.0, gt=0)
    #: How long the first connection to NATS may take before it fails with its cause.
    connect_timeout: float = Field(default=2.0, gt=0)
    #: How often each connection asks its NATS server for a PONG. Three unanswered in a row
    #: and the connection is taken for dead and moves to another server of the cluster: a node
    #: that froze (a stalled VM, a SIGSTOP) or was cut off without a reset is left within four
    #: intervals and one connect attempt, before an agent's lease lapses — not after nats-py's
    #: default (2 minutes, two PINGs; docs/operations.md, "A NATS node froze").
    nats_ping_interval: float = Field(default=2.0, gt=0)
    max_payload: int = Field(default=1 << 20, gt=0)
    #: Route requests a hub has in flight before it takes more only from namespaces below
    #: their fair share of them (the others get REACH_THROTTLED; docs/architecture.md,
    #: "Fairness"), and nothing more past four times it. Also the other requests a hub (or an agent)
    #: works on at once before it stops reading more.
    hub_concurrency: int = Field(default=2048, ge=1)
    #: Delivery attempts a hub makes (to different agents) before an ACCEPT.
    route_attempts: int = Field(default=3, ge=1, le=20)
    default_strategy: str = "least_loaded"
    #: Direct mode: how long a Client reuses a hub's decision (and its alternates) for the same
    #: target, strategy and region/zone. 0 = ask a hub on every request.
    direct_cache_ttl: float = Field(default=1.0, ge=0)
    #: least_loaded scoring: in-flight/max_concurrency, queue depth and pressure coefficients,
    #: and the utilisation above which an agent is steeply de-weighted (docs/selectors.md).
    load_weight_inflight: float = Field(default=1.0, ge=0)
    load_weight_queue: float = Field(default=0.5, ge=0)
    load_weight_pressure: float = Field(default=0.5, ge=0)
    load_saturation: float = Field(default=0.85, gt=0, lt=1)

    # JetStream
    kv_replicas: int = Field(default=1, ge=1, le=5)
    #: How long a starting hub keeps asking again for its JetStream setup (its streams,
    #: buckets and consumers) while JetStream does not answer or answers "unavailable" — a
    #: leader election, its server cut off from the others, a cluster without a quorum —
    #: before it gives up with ``REACH_UNAVAILABLE`` naming what it could not set up.
    start_timeout: float = Field(default=60.0, gt=0)

    # backpressure: per-namespace token buckets (requests/s and burst)
    route_rate: float = Field(default=50_000.0, gt=0)
    route_burst: float = Field(default=100_000.0, gt=0)
    register_rate: float = Field(default=2_000.0, gt=0)
    register_burst: float = Field(default=5_000.0, gt=0)

    # sticky sessions: how long an idle session keeps its agent
    sticky_ttl: float = Field(default=1800.0, gt=0)

    # circuit breaker (per agent, per hub): window, failure ratio, minimum requests, open time
    breaker_window: float = Field(default=60.0, gt=0)
    breaker_failure_ratio: float = Field(default=0.5, gt=0, le=1)
    breaker_min_requests: int = Field(default=5, ge=1)
    breaker_open_timeout: float = Field(default=30.0, gt=0)
    #: Failures one reporter's ``report`` messages may add to one agent's breaker window.
    breaker_report_budget: int = Field(default=3, ge=0)

    # audit stream
    audit_enabled: bool = True
    audit_max_age: float = Field(default=7 * 24 * 3600.0, gt=0)
    audit_max_bytes: int = Field(default=1 << 30, gt=0)

    # durable workflows (docs/workflows.md); every interval can also be set per step
    #: Ack wait of the hubs' shared workflow consumer: how soon another hub takes over the
    #: workflows of a hub that died (the owner sends +WPI every third of it).
    workflow_ack_wait: float = Field(default=30.0, gt=0)
    #: Ack wait of an agent's work consumer (the SDK sends +WPI while a handler runs).
    work_ack_wait: float = Field(default=30.0, gt=0)
    #: Workflows one hub runs at once; beyond it, only a namespace below its fair share of them
    #: starts more (docs/workflows.md, "Fairness between namespaces").
    workflow_concurrency: int = Field(default=1024, ge=1)
    #: PENDING -> DELIVERED deadline of one attempt; past it a retry is safe (not accepted).
    step_deliver_timeout: float = Field(default=5.0, gt=0)
    #: A step still running after this long reports RUNNING, and again at this interval.
    step_running_interval: float = Field(default=5.0, gt=0)
    #: No status event from an accepted attempt for this long: ask the agent (ctl task_state).
    step_silence_timeout: float = Field(default=15.0, gt=0)
    #: An attempt still reported running this long past its step's ``timeout`` (counted from
    #: when the hub heard its handler start) is taken as a TIMEOUT of that attempt and its
    #: handler told to stop: an agent that does not end its handlers holds no step to the
    #: workflow's deadline. Longer than ``handler_abandon_grace``: an agent of this SDK
    #: answers first.
    step_overdue_grace: float = Field(default=15.0, gt=0)
    #: Agent: a handler still running this long after its timeout cancelled it (it ignores
    #: cancellation) is abandoned. A step's attempt is answered TIMEOUT and its keep-alives
    #: stop (what the handler returns then is dropped); a request-reply task is TIMEOUT for a
    #: copy asked meanwhile. The handler keeps its slot until it returns.
    handler_abandon_grace: float = Field(default=5.0, gt=0)
    #: Handler failures retried per step (retryable errors only).
    step_retries: int = Field(default=2, ge=0, le=100)
    #: Delivery attempts with exponential backoff before slow pending re-delivery.
    step_fast_attempts: int = Field(default=3, ge=0, le=100)
    #: Backoff: base * 2**(n-1), capped, with jitter.
    retry_base: float = Field(default=1.0, gt=0)
    retry_cap: float = Field(default=32.0, gt=0)
    #: Re-delivery interval of a step no agent could take, until ``task_ttl``.
    pending_interval: float = Field(default=30.0, gt=0)
    #: How long a step may stay unfinished (retrying / pending) before it is TIMEOUT.
    task_ttl: float = Field(default=7200.0, gt=0)
    #: Age of workflow records, task records, stored results and events in JetStream (the max
    #: age of the REACH_WF* / REACH_WORK / REACH_STATUS streams and the TTL of the workflow KV
    #: buckets; a hub applies it to existing ones at start). It bounds how long a workflow may
    #: run (``longest_workflow``): a record must outlive the run that writes it.
    workflow_retention: float = Field(default=86400.0, gt=0)
    #: How long a hub holds a workflow event (``start``, ``step``) before publishing it; events
    #: still held when the workflow's result is stored are dropped, as ``.done`` says it all.
    #: 0 = hold none (every event is stored).
    workflow_event_hold: float = Field(default=0.1, ge=0, le=60)
    #: Duplicate window of workflow submissions and work messages (``Nats-Msg-Id``).
    dedup_window: float = Field(default=600.0, gt=0)
    #: Results an agent keeps in memory for idempotency (all are also kept in KV).
    result_cache: int = Field(default=10_000, ge=16)

    #: Capabilities that get a series of their own in ``reach_task_duration_seconds`` (each
    #: costs 38 series: 36 buckets, sum, count); the ones a hub sees after them share
    #: ``capability="other"``, but for a namespace that made fewer than another (by two): it
    #: takes that one's oldest. Anyone may mint capabilities: the scrape stays bounded.
    metrics_capability_series: int = Field(default=64, ge=1, le=4096)

    # hub HTTP (metrics, REST, dashboard). 0 = pick a free port, None = off.
    http_host: str = "127.0.0.1"
    http_port: int | None = Field(default=None, ge=0, le=65535)
    #: When set, ``/api/*``, ``/mcp`` and ``/a2a/*`` want ``Authorization: Bearer <token>``
    #: (set it through ``REACH_HTTP_TOKEN``, not a command line). ``/metrics``, ``/healthz``,
    #: ``/openapi.json`` and the dashboard page itself stay open.
    http_token: str | None = Field(default=None, min_length=16, repr=False)
    #: ``/metrics`` wants the bearer token too, as ``/api/*`` does: it names namespaces and
    #: capabilities. Off by default (scrapers configured without a token keep working);
    #: Prometheus sends one with ``authorization: {credentials: ...}`` in its scrape config.
    #: In secure mode without ``http_token``, ``/metrics`` is then closed like the API.
    http_metrics_auth: bool = False
    #: ``Host`` names the hub's HTTP answers besides loopback names and ``http_host`` itself
    #: (DNS-rebinding defence); ``*`` accepts any. Comma separated in ``REACH_HTTP_ALLOWED_HOSTS``.
    http_allowed_hosts: tuple[str, ...] = ()
    #: Browser origins (``scheme://host[:port]``) allowed to POST besides the hub's own.
    http_allowed_origins: tuple[str, ...] = ()
    #: Trace viewer link for the dashboard's trace ids: an ``http(s)://`` URL containing
    #: ``{trace_id}``, e.g. ``http://localhost:16686/trace/{trace_id}`` (Jaeger). Unset: the page
    #: shows trace ids as text.
    trace_url_template: str | None = Field(
        default=None, max_length=2048, pattern=r"^https?://[^\s]*\{trace_id\}[^\s]*$"
    )

    @field_validator("namespaces", "http_allowed_hosts", "http_allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        # Environment variables and YAML scalars: "a, b" means ("a", "b").
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @property
    def longest_workflow(self) -> float:
        """The longest a workflow may run (its ``timeout``, or ``task_ttl`` without one):
        ``workflow_retention`` less time for its final write (the larger of a minute and two
        ``workflow_ack_wait``). A record is written when the workflow starts and when it
        ends, and JetStream drops it ``workflow_retention`` after its write: a run that
        outlived it lost its record, and ended TIMEOUT at that age, its results dropped."""
        return self.workflow_retention - max(60.0, 2 * self.workflow_ack_wait)

    @model_validator(mode="after")
    def _retention(self) -> MeshSettings:
        if self.task_ttl > self.longest_workflow:
            raise BadRequestError(
                f"workflow_retention {self.workflow_retention:g}s is shorter than task_ttl "
                f"({self.task_ttl:g}s) and the time to write a result "
                f"({self.workflow_retention - self.longest_workflow:g}s): records of running "
                "workflows would expire; raise workflow_retention or lower task_ttl"
            )
        return self

    @model_validator(mode="after")
    def _lease(self) -> MeshSettings:
        # The registration's rule (minimums included): an agent's settings a hub would refuse
        # fail here, not at every registration.
        err = lease_error(self.heartbeat_interval, self.lease_timeout)
        if err is not None:
            raise err
        return self


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> MeshSettings:
    """Defaults < YAML file (``path`` or ``$REACH_CONFIG``) < ``REACH_*`` env < ``overrides``.

    A value that fails validation raises :class:`BadRequestError` naming where it came from
    (``REACH_HTTP_TOKEN``, a YAML key, an argument) and what is allowed; an unknown YAML key
    names the closest valid one.
    """
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    path = path or os.environ.get(f"{ENV_PREFIX}CONFIG")
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise BadRequestError(f"cannot read settings file {path}: {err}") from err
        if not isinstance(loaded, dict):
            raise BadRequestError(f"settings file {path} must hold a mapping")
        values.update(loaded)
        source.update({str(k): f"{path}: {k}" for k in loaded})
    fields = MeshSettings.model_fields
    for name in fields:
        env = os.environ.get(f"{ENV_PREFIX}{name.upper()}")
        if env is not None:
            values[name] = env
            source[name] = f"{ENV_PREFIX}{name.upper()}"
    _warn_misspelled_env()
    if os.environ.get(f"{ENV_PREFIX}NATS_URL") is not None and "nats_url" not in overrides:
        values["nats_url"] = os.environ[f"{ENV_PREFIX}NATS_URL"] or None
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    source.update({k: k for k in given})
    try:
        return MeshSettings.model_validate(values)
    except ValidationError as err:
        raise BadRequestError(_explain(err, source)) from err


#: Misspelled variables warned of already: once per process, not once per ``Client``.
_warned_env: set[str] = set()


def _warn_misspelled_env() -> None:
    """A ``REACH_*`` variable that is no setting but nearly spells one (``REACH_REQUEST_TIMOUT``)
    is ignored, as any other variable: say so, once, instead of running on the default. A
    warning, not an error: other ``REACH_*`` variables (``REACH_CONFIG``, ``REACH_LOG_LEVEL``,
    ``REACH_STATE_DIR``, ...) are no settings and spell none."""
    names = [f"{ENV_PREFIX}{name.upper()}" for name in MeshSettings.model_fields]
    for var in os.environ:
        if not var.startswith(ENV_PREFIX) or var in names or var in _warned_env:
            continue
        close = difflib.get_close_matches(var, names, n=1, cutoff=0.9)
        if close:
            _warned_env.add(var)
            logging.getLogger("reach_mesh.config").warning(
                "%s is not a setting and is ignored: did you mean %s?", var, close[0]
            )


def _explain(err: ValidationError, source: dict[str, str]) -> str:
    """The first problem of ``err`` as one sentence with its fix."""
    first = err.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else "settings"
    where = source.get(name, name)
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(name, list(MeshSettings.model_fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        # ``where`` is "<file>: <key>" for a settings file's key: the key quoted, the file named.
        file = where[: -len(name)].rstrip(": ") if where != name and where.endswith(name) else ""
        return f"unknown setting {name!r}" + (f" in {file}" if file else "") + hint
    if first["type"] == "string_too_short":
        need = (first.get("ctx") or {}).get("min_length")
        return f"{where} is too short: it needs at least {need} characters"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    unit = ""
    given = first.get("input")
    if first["type"] in _NUMBER_ERRORS and isinstance(given, str) and _WITH_UNIT.match(given):
        # ``request_timeout: 5s``, ``max_payload: 1MiB``: the settings take plain numbers.
        unit = f" ({given!r}: a plain number, times in seconds and sizes in bytes)"
    return f"{where}: {first['msg']}{unit}{more}"


#: Pydantic's error types for a string that does not parse as a number.
_NUMBER_ERRORS: Final = frozenset({"float_parsing", "int_parsing", "int_from_float"})
#: A number followed by a unit: ``5s``, ``30 min``, ``1MiB``, ``1.5GB``.
_WITH_UNIT: Final = re.compile(r"\s*[-+]?[0-9][0-9_.]*\s*[A-Za-z]+\s*$")
