"""Dashboard pages (server-rendered; the JS in static/dashboard/ adds live updates and the graph).
Every page shows the projects the user sees (dashboard.access): staff every project, members
their own; another project's task answers 404."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.projects import MAINTAINER, key_project
from cache.models import AuditEntry
from core.errors import NotFound
from core.inputs import INT32, INT64

from . import access, selectors, trees

AUDIT_PAGE_SIZE = 50


def _scope(request) -> dict:
    """The project switcher: the projects the user sees, and the one chosen (?project=; none:
    all of them). An unknown or unseen choice is a 404."""
    projects = access.visible_projects(request.user)
    chosen = request.GET.get("project", "")
    if chosen and chosen not in {p.name for p in projects}:
        raise Http404("No such project.")
    ids = [p.pk for p in projects if not chosen or p.name == chosen]
    every = request.user.is_staff and not chosen
    return {
        "projects": projects,
        "project_filter": chosen,
        "project_ids": None if every else ids,
        "many_projects": len(projects) > 1 and not chosen,
    }


@require_GET
@login_required
def overview(request):
    scope = _scope(request)
    context = selectors.overview(
        search=request.GET.get("q", "").strip(), page=request.GET.get("page"), project_ids=scope["project_ids"]
    )
    template = "dashboard/_overview_table.html" if request.GET.get("fragment") else "dashboard/overview.html"
    return render(request, template, {**context, **scope})


def _task_context(request, task_id: str) -> dict:
    access.task_check(request.user, task_id)
    return {"can_control": access.can_control(request.user, key_project(task_id))}


@require_GET
@login_required
def task(request, task_id: str):
    allowed = _task_context(request, task_id)
    try:
        detail = selectors.task_detail(task_id=task_id, rollouts_page=request.GET.get("page"))
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(request, "dashboard/task.html", {**detail, **allowed})


@require_GET
@login_required
def graph(request, task_id: str):
    allowed = _task_context(request, task_id)
    try:
        initial = selectors.graph_slice(task_id=task_id)
        context = selectors.task_counts(task_id=task_id)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(
        request, "dashboard/graph.html", {**context, **allowed, "initial": initial, "levels": selectors.GRAPH_LEVELS}
    )


@require_GET
@login_required
def tree(request, task_id: str):
    """An epoch's rollout tree (?epoch=, default the latest), a page of the export at a time
    (?after= its cursor; ?page= the page's number, for display), with the sharing ratios."""
    allowed = _task_context(request, task_id)
    epoch = _query_int(request, "epoch", INT32)
    after = _query_int(request, "after", (0, INT64[1])) or 0
    number = _query_int(request, "page", (1, INT32[1])) or 1
    try:
        context = trees.tree_page(task_id=task_id, epoch=epoch, after=after)
    except NotFound as exc:
        raise Http404(exc.message) from None
    first = (number - 1) * trees.PAGE_ROLLOUTS + 1
    numbering = {"page": number, "first": first, "last": first + len(context["rows"]) - 1}
    return render(request, "dashboard/tree.html", {**context, **allowed, **numbering})


def _query_int(request, name: str, bounds: tuple[int, int]) -> int | None:
    """An integer query parameter, None when absent; a malformed one is a 404 (no such page)."""
    value = request.GET.get(name, "")
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not bounds[0] <= number <= bounds[1]:
        raise Http404(f"No such page: {name}={value!r}.")
    return number


@require_GET
@login_required
def node(request, task_id: str, node_id: int):
    allowed = _task_context(request, task_id)
    try:
        detail = selectors.node_detail(task_id=task_id, node_id=node_id, snapshots_page=request.GET.get("page"))
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(
        request,
        "dashboard/node.html",
        {**detail, **allowed, "task_id": task_id, "task": detail["node"].task, "here": f"node {node_id}"},
    )


@require_GET
@login_required
def pools(request):
    """Every task's pools summed up, a page of tasks at a time; ?task=<key> one task's pools and
    its live snapshots, a page at a time. ?fragment=1: the part the page refreshes live."""
    scope = _scope(request)
    task_id = request.GET.get("task", "")
    page = request.GET.get("page")
    if task_id:
        context = _pool_task_context(request, task_id, scope, page)
    else:
        context = {"pools": selectors.pools(project_ids=scope["project_ids"], page=page)}
    query = request.GET.copy()
    query.pop("fragment", None)
    here = f"{request.path}?{query.urlencode()}" if query else request.path
    query["fragment"] = "1"
    template = "dashboard/_pools_body.html" if request.GET.get("fragment") else "dashboard/pools.html"
    can_stop = MAINTAINER in (access.roles(request.user) or {}).values()
    return render(
        request,
        template,
        {**scope, **context, "can_stop": can_stop, "here": here, "fragment_url": f"{request.path}?{query.urlencode()}"},
    )


def _pool_task_context(request, task_id: str, scope: dict, page: str | None) -> dict:
    """One task's pools; a task of a project the user does not see, or not of the chosen one, is a 404."""
    project = key_project(task_id)
    if scope["project_filter"] and project != scope["project_filter"]:
        raise Http404("No such task in this project.")
    access.task_check(request.user, task_id)
    try:
        detail = selectors.pool_task(task_id=task_id, page=page)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return {"pools": detail, "task": detail["task"], "can_control": access.can_control(request.user, project)}


@require_GET
@login_required
def project(request, name: str):
    """A project's grants against its usage (live sandboxes, snapshot bytes, request rate), its
    tokens and members."""
    access.project_check(request.user, name)
    try:
        detail = selectors.project_detail(
            name=name, tokens_page=request.GET.get("tokens_page"), members_page=request.GET.get("members_page")
        )
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(
        request,
        "dashboard/project.html",
        {
            **detail,
            "projects": access.visible_projects(request.user),
            "can_control": access.can_control(request.user, name),
        },
    )


@require_GET
@login_required
def audit(request):
    scope = _scope(request)
    entries = AuditEntry.objects.all()
    if scope["project_ids"] is not None:
        entries = entries.filter(project_id__in=scope["project_ids"])
    task_id = request.GET.get("task", "")
    if task_id:
        entries = entries.filter(task_id=task_id)
    page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "dashboard/audit.html", {**scope, "page": page, "task_filter": task_id})
