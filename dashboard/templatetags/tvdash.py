"""Formatting of the dashboard's figures."""

from __future__ import annotations

from django import template

from accounts.projects import task_public_id

register = template.Library()


@register.filter
def percent(value) -> str:
    if value is None:
        return "–"
    return f"{100 * float(value):.1f} %"


@register.filter
def duration(ms) -> str:
    """Milliseconds as a person reads them: 850 ms, 4.2 s, 3 min 20 s, 2 h 05 min."""
    if ms is None:
        return "–"
    ms = float(ms)
    if ms < 1000:
        return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@register.filter
def size(n) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


@register.filter
def get(mapping, key):
    return (mapping or {}).get(key)


@register.filter
def tojson(value) -> str:
    """JSON for a data-* attribute (autoescaping then makes it attribute-safe)."""
    import json

    return json.dumps(value, separators=(",", ":"), default=str)


@register.filter
def task_name(key: str) -> str:
    """A task's id in its project, from its key (accounts.projects)."""
    return task_public_id(key) if isinstance(key, str) else key


@register.filter
def sharing(value) -> str:
    """A sharing ratio (dashboard.trees.Sharing): "1.26×"; "n/a" when no token was given, "–"
    when it was not computed (over the request's bounds)."""
    if value is None:
        return "–"
    return "n/a" if value.ratio is None else f"{value.ratio:.2f}×"


@register.simple_tag(takes_context=True)
def page_query(context, number, key: str = "page") -> str:
    """This page's query string with page `number` of a list (`key`: its parameter), without the
    live fragment's flag: a pager inside a refreshed fragment leads to pages, not fragments."""
    query = context["request"].GET.copy()
    query.pop("fragment", None)
    query[key] = number
    return f"?{query.urlencode()}"
