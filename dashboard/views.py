"""Dashboard pages (server-rendered; the JS in static/dashboard/ adds live updates and the graph)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_GET

from cache.errors import NotFound

from . import selectors
from .models import AuditEntry

AUDIT_PAGE_SIZE = 50


@require_GET
@login_required
def overview(request):
    context = selectors.overview(search=request.GET.get("q", "").strip(), page=request.GET.get("page"))
    template = "dashboard/_overview_table.html" if request.GET.get("fragment") else "dashboard/overview.html"
    return render(request, template, context)


@require_GET
@login_required
def task(request, task_id: str):
    try:
        detail = selectors.task_detail(task_id=task_id)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(request, "dashboard/task.html", detail)


@require_GET
@login_required
def graph(request, task_id: str):
    try:
        initial = selectors.graph_slice(task_id=task_id)
        context = selectors.task_counts(task_id=task_id)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(request, "dashboard/graph.html", {**context, "initial": initial, "levels": selectors.GRAPH_LEVELS})


@require_GET
@login_required
def node(request, task_id: str, node_id: int):
    try:
        detail = selectors.node_detail(task_id=task_id, node_id=node_id)
    except NotFound as exc:
        raise Http404(exc.message) from None
    return render(request, "dashboard/node.html", {**detail, "task_id": task_id, "task": detail["node"].task,
                                                   "here": f"node {node_id}"})


@require_GET
@login_required
def pools(request):
    template = "dashboard/_pools_body.html" if request.GET.get("fragment") else "dashboard/pools.html"
    return render(request, template, {"pools": selectors.pools()})


@require_GET
@login_required
def audit(request):
    entries = AuditEntry.objects.all()
    task_id = request.GET.get("task", "")
    if task_id:
        entries = entries.filter(task_id=task_id)
    page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    return render(request, "dashboard/audit.html", {"page": page, "task_filter": task_id})
