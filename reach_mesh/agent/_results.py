"""The agent's module-level helpers: checking a handler's signature, labels, encoding a
handler's result, tool specs, ending the handle span and error bodies."""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final

from opentelemetry import trace
from pydantic import BaseModel, TypeAdapter
from pydantic_core import from_json, to_json

from reach_mesh.agent._task import Task
from reach_mesh.errors import (
    BadRequestError,
    MeshTimeoutError,
    ReachError,
)
from reach_mesh.models import (
    LABEL_MAX,
    ErrorBody,
    TaskReply,
    TaskState,
    ToolSpec,
    label_key_ok,
)

if typing.TYPE_CHECKING:
    from reach_mesh.agent._serving import _Handler

#: Python's JSON writer, as the handler-result check has always used it, but compact and
#: refusing NaN/Infinity (those take the general path, where pydantic writes them as null).
_JSON: Final = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
#: A handler error's message and details, at most (``_error_body``).
_ERROR_MESSAGE_MAX: Final = 2000
_ERROR_DETAILS_MAX: Final = 8 * 1024
_json_string: Final[Callable[[str], str]] = json.encoder.encode_basestring_ascii
#: The C writer behind ``_JSON.encode``, made once: ``encode`` builds it anew on every call (half
#: its cost for a small result). No circular-reference check (``markers``): a circular result
#: hits the recursion limit instead, and the general path then words the error.
_make_encoder: Any = getattr(json.encoder, "c_make_encoder", None)  # untyped in typeshed
_encode_json: Final[Callable[[Any, int], Iterable[str]] | None] = (
    None
    if _make_encoder is None
    else _make_encoder(None, _JSON.default, _json_string, None, ":", ",", False, False, False)
)
#: A SUCCEEDED reply around the result's JSON (``Agent._success``).
_SUCCEEDED: Final = (
    b'{"task_id":%b,"attempt":%d%b,"result":%b,"duration_ms":%.3f,"queued_ms":%.3f,"cached":false}'
)
_SUCCEEDED_NULL: Final = (
    b'{"task_id":%b,"attempt":%d%b,"duration_ms":%.3f,"queued_ms":%.3f,"cached":false}'
)


def _handler_signature(
    fn: Callable[..., Any], capability: str, localns: Mapping[str, Any]
) -> tuple[bool, Any, Any]:
    """(whether the handler takes the bare payload, payload type, return type) of a
    handler, or a ``TypeError`` that says what to change."""
    params = list(inspect.signature(fn).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in positional:
        raise TypeError(f"handler for {capability} must take the task as its first parameter")
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    extra = [
        p.name
        for p in params[1:]
        if p.default is inspect.Parameter.empty and p.kind not in variadic
    ]
    if extra:
        raise TypeError(
            f"handler for {capability}: parameters {', '.join(extra)} need defaults "
            "(a handler is called with the task alone)"
        )
    localns = dict(localns)
    closure = inspect.getclosurevars(fn).nonlocals if fn.__closure__ else {}
    localns.update(closure)
    try:
        hints = typing.get_type_hints(fn, localns=localns)
    except NameError as err:
        raise TypeError(
            f"handler for {capability}: cannot resolve an annotation ({err}); import the "
            "name where the handler is defined"
        ) from err
    ann = hints.get(params[0].name)
    ret = hints.get("return")
    if ann is None or ann is Task:
        return False, Any, ret
    if typing.get_origin(ann) is Task:
        args = typing.get_args(ann)
        return False, args[0] if args else Any, ret
    return True, ann, ret


def _labels(agent_id: str, labels: Mapping[str, object]) -> dict[str, str]:
    """Labels as strings: numbers and booleans are written the way a selector spells them
    (``16``, ``0.5``, ``true``); anything else is a :class:`BadRequestError` naming the label."""
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not label_key_ok(key) or len(key) > LABEL_MAX:
            raise BadRequestError(
                f"agent {agent_id}: invalid label key {key!r}: expected [a-z0-9][a-z0-9_.-]* "
                f"(at most {LABEL_MAX} characters)"
            )
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = f"{value:g}" if isinstance(value, float) else str(value)
        elif isinstance(value, str):
            text = value
        else:
            raise BadRequestError(
                f"agent {agent_id}: label {key!r} is a {type(value).__name__} ({value!r}); "
                "label values are strings (numbers and booleans are converted)"
            )
        if not text or len(text) > LABEL_MAX:
            raise BadRequestError(
                f"agent {agent_id}: label {key!r} must be 1 to {LABEL_MAX} characters"
            )
        same = next((k for k in out if k.lower() == key.lower()), None)
        if same is not None:
            raise BadRequestError(
                f"agent {agent_id}: label keys {same!r} and {key!r} differ only in case (keys "
                "are read in any case): keep one"
            )
        out[key] = text
    return out


def _bare(fn: Callable[[Any], Awaitable[Any]]) -> Callable[[Task[Any]], Awaitable[Any]]:
    """A handler that takes the payload alone, called with a task."""

    def call(task: Task[Any]) -> Awaitable[Any]:
        return fn(task.payload)

    return call


def _result_json(handler: _Handler, result: Any) -> bytes:
    """The handler's result as reply JSON, the same value ``_dump`` + ``protocol.encode`` would
    write. Raises on anything unusual; the caller then takes that general path."""
    if handler.result is not None:
        out = handler.result.dump_json(result)
    elif isinstance(result, BaseModel):
        out = result.model_dump_json().encode()
    elif _encode_json is not None:
        out = "".join(_encode_json(result, 0)).encode()
        if b"\\ud" in out:
            # A surrogate's escape: a pair is a character beyond the BMP (an emoji), a lone
            # one no receiver reads (pydantic's parser refuses it): the general path says so.
            from_json(out)
        return out
    else:  # pragma: no cover - CPython has the C writer
        return _JSON.encode(result).encode()
    if b"NaN" in out or b"Infinity" in out:
        # pydantic's dump_json writes non-finite floats as NaN/Infinity (not JSON); inside a
        # TaskReply they become null. Rare (or a string that says so): the general path.
        raise ValueError("non-finite float")
    return out


def _dump(handler: _Handler, result: Any) -> Any:
    if handler.result is not None:
        return handler.result.dump_python(result, mode="json")
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    json.dumps(result)  # raises early for non-JSON results
    return result


def _tool_spec(
    name: str, capability: str, payload: TypeAdapter[Any], description: str | None
) -> ToolSpec:
    """A tool from a handler: the payload type's JSON Schema as its parameters."""
    try:
        schema = payload.json_schema()
    except Exception as err:  # pydantic cannot express every type as JSON Schema
        raise TypeError(f"tool {name!r}: no JSON Schema for the payload type: {err}") from err
    if not schema:
        schema = {"type": "object"}  # ``Task[Any]``: any arguments
    elif schema.get("type", "object") != "object":
        # MCP passes a tool's arguments as one JSON object, which becomes the payload.
        raise TypeError(f"tool {name!r}: the payload type must be an object, e.g. a model")
    return ToolSpec(
        name=name,
        description=inspect.cleandoc(description or "")[:4096],
        parameters=schema,
        capability=capability,
    )


def _end_handle_span(sp: trace.Span, out: bytes | TaskReply) -> None:
    """The attempt's final state as the last event of its ``reach.handle`` span; status ERROR
    (with the error code and message) unless it SUCCEEDED."""
    if not sp.is_recording():
        return
    if type(out) is bytes:
        sp.add_event(TaskState.SUCCEEDED.value)
        return
    reply = typing.cast(TaskReply, out)
    error = reply.error
    attributes = {} if error is None else {"reach.error.code": error.code}
    sp.add_event(reply.state.value, attributes)
    if reply.state is not TaskState.SUCCEEDED:
        message = reply.state.value if error is None else f"{error.code}: {error.message}"
        sp.set_status(trace.Status(trace.StatusCode.ERROR, message[:500]))


def _abandoned_error(timeout: float) -> ErrorBody:
    """The error of an attempt whose handler ignored its ``timeout``'s cancellation for
    ``handler_abandon_grace``: the agent let it go (a step's or a request-reply task's)."""
    return ErrorBody(
        code=MeshTimeoutError.code,
        message=f"handler did not finish within {timeout:.3g}s and did not stop when "
        "cancelled: abandoned",
        details={"abandoned": True},
    )


def _error_body(err: ReachError) -> ErrorBody:
    """A handler's error as its answer says it: the message cut at 2,000 characters and
    details over 8 KiB of JSON left out (but ``retryable``), so that a failure always fits in
    the answer, the status and the workflow record that carry it."""
    details = err.details
    if details:
        size: int | str
        try:
            size = len(to_json(details))
        except Exception:
            size = "not JSON"  # not sendable either
        if not isinstance(size, int) or size > _ERROR_DETAILS_MAX:
            kept = {k: details[k] for k in ("retryable",) if k in details}
            details = {**kept, "details_left_out": size}
    return ErrorBody(
        code=sendable(err.code), message=sendable(err.message[:_ERROR_MESSAGE_MAX]), details=details
    )


def sendable(text: str) -> str:
    """``text`` as JSON can carry it: a lone surrogate (a name decoded with
    ``errors="surrogateescape"``) written as its escape, ``\\udce9``; no JSON writer of the mesh
    takes one as it is."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text
