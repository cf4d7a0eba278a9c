"""Number formatting shared by the report's sections."""

from __future__ import annotations

from typing import Any

__all__ = ["_f", "_get", "_ms", "_pct", "_x"]


def _f(x: Any, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float | int):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{nd}f}"
    return str(x)


def _ms(ms: dict[str, Any]) -> str:
    """median (min-max) of a repeated measurement."""
    if ms["min"] == ms["max"]:
        return _f(ms["median"])
    return f"{_f(ms['median'])} ({_f(ms['min'])}-{_f(ms['max'])})"


def _x(r: Any) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _pct(r: Any) -> str:
    return "-" if r is None else f"{100 * r:.0f} %"


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d
