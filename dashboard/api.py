"""Session-authenticated JSON for the graph browser (/dashboard-api/): the page loads the graph a few
levels at a time, so a task of 10,000+ nodes stays responsive."""

from __future__ import annotations

from functools import wraps

from django.http import JsonResponse
from django.views.decorators.http import require_GET

from accounts.projects import key_project
from cache.notfound import unknown_task
from core.api.errors import error_response
from core.errors import ApplicationError, InvalidInput, NotAuthenticated

from . import access, selectors


def _json_view(view):
    """Login required (401 JSON, not a redirect), and the task's project seen by the user (404 JSON
    otherwise); application errors become the API's error JSON."""

    @require_GET
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return error_response(NotAuthenticated("Log in first."))
        try:
            if not access.can_see(request.user, key_project(kwargs["task_id"])):  # another project's: as unknown
                raise unknown_task(kwargs["task_id"])
            return JsonResponse(view(request, *args, **kwargs))
        except ApplicationError as exc:
            return error_response(exc)

    return wrapper


def _int(request, name: str, default: int | None, *, low: int = 0, high: int | None = None) -> int | None:
    raw = request.GET.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput(f"'{name}' must be an integer.", details={"field": name}) from None
    if value < low or (high is not None and value > high):
        raise InvalidInput(f"'{name}' is out of range.", details={"field": name})
    return value


@_json_view
def graph(request, task_id: str):
    root = _int(request, "root", None)
    levels = _int(request, "depth", selectors.GRAPH_LEVELS, low=1, high=1000)
    return selectors.graph_slice(task_id=task_id, root=root, levels=levels)


@_json_view
def nodes(request, task_id: str):
    try:
        ids = [int(part) for part in request.GET.get("ids", "").split(",") if part]
    except ValueError:
        raise InvalidInput("'ids' must be comma-separated integers.", details={"field": "ids"}) from None
    return {"task_id": task_id, "nodes": selectors.graph_nodes(task_id=task_id, ids=ids)}


@_json_view
def reveal(request, task_id: str, node_id: int):
    return selectors.graph_reveal(task_id=task_id, node_id=node_id)


@_json_view
def search(request, task_id: str):
    return {"task_id": task_id, "nodes": selectors.graph_search(task_id=task_id, text=request.GET.get("q", "")[:200])}
