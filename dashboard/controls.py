"""Admin controls: staff and the maintainers of the target's project (dashboard.access; another
project's target is a 404, a trainer member gets 403), CSRF-protected, with a confirmation step.
GET shows what the action will do; POST with confirm=yes does it through the audited service in
`cache.services.admin`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods

from accounts.projects import MAINTAINER, key_project
from cache import services
from cache.models import Node, Snapshot, Task
from core.errors import ApplicationError
from sandboxes import services as sandbox_services
from sandboxes.models import Sandbox

from . import access, selectors


def controller_required(view):
    """Anonymous: to the login page. A task's controls: its project's maintainers and staff (404
    for a project the user does not see, 403 for a trainer member). The pool's: staff, and
    maintainers of some project (the sandbox's project is checked when it is named)."""

    @login_required
    @wraps(view)
    def wrapper(request, *args, task_id: str | None = None, **kwargs):
        user = request.user
        if task_id is not None:
            access.task_check(user, task_id, write=True)
        elif not user.is_staff and MAINTAINER not in (access.roles(user) or {}).values():
            raise PermissionDenied("Staff and project maintainers only.")
        return view(request, *args, task_id=task_id, **kwargs)

    return wrapper


def _sandbox_task(user, sandbox_id: str) -> str:
    """The key of the task whose sandbox this is, if the user may stop it (404 otherwise, as for
    a sandbox that does not exist; 403 for a trainer member)."""
    row = (
        Sandbox.objects.filter(pk=int(sandbox_id)).values_list("task_id", flat=True).first()
        if sandbox_id.isdigit() and len(sandbox_id) < 19
        else None
    )
    if row is None and user.is_staff:
        return ""  # the audited service refuses it (and logs the refusal)
    if row is None or not access.can_see(user, key_project(row)):
        raise Http404(f"No sandbox '{sandbox_id}'.")
    if not access.can_control(user, key_project(row)):
        raise PermissionDenied("Maintainers of this project and staff only.")
    return row


class BudgetForm(forms.Form):
    sandbox_budget = forms.IntegerField(min_value=0, max_value=1_000_000, label="New budget (live snapshots)")


class SandboxForm(forms.Form):
    sandbox_id = forms.CharField(max_length=200, label="Sandbox id")


@dataclass(frozen=True)
class Control:
    title: str
    explain: str
    danger: bool
    run: Callable  # (user, task_id, node_id, cleaned form data) -> AuditEntry
    form: type[forms.Form] | None = None


CONTROLS: dict[str, Control] = {
    "evict-subtree": Control(
        "Evict subtree",
        "Evicts the live snapshots of this node and all its descendants and deletes those nodes with their "
        "results. Rollouts that reach them again execute and record them afresh.",
        True,
        lambda user, task_id, node_id, data: services.admin_subtree_evict(actor=user, task_id=task_id, node_id=node_id),
    ),
    "evict-snapshot": Control(
        "Evict snapshot",
        "Evicts only this node's live snapshot. Its result stays cached; a miss below it replays from an "
        "earlier snapshot.",
        True,
        lambda user, task_id, node_id, data: services.admin_snapshot_evict(
            actor=user, task_id=task_id, node_id=node_id
        ),
    ),
    "pin": Control(
        "Pin node",
        "A pinned node's snapshot is never evicted by the budget.",
        False,
        lambda user, task_id, node_id, data: services.admin_node_pin(
            actor=user, task_id=task_id, node_id=node_id, pinned=True
        ),
    ),
    "unpin": Control(
        "Unpin node",
        "The node's snapshot becomes a candidate for eviction again.",
        False,
        lambda user, task_id, node_id, data: services.admin_node_pin(
            actor=user, task_id=task_id, node_id=node_id, pinned=False
        ),
    ),
    "flush": Control(
        "Flush task",
        "Deletes every node, snapshot, rollout and counter of this task. The task and its settings stay.",
        True,
        lambda user, task_id, node_id, data: services.admin_task_flush(actor=user, task_id=task_id),
    ),
    "budget": Control(
        "Change budget",
        "Sets the task's budget of live snapshots, then enforces it: over budget, the snapshots of lowest "
        "expected reuse are evicted (leased and pinned ones are spared).",
        False,
        lambda user, task_id, node_id, data: services.admin_budget_set(
            actor=user, task_id=task_id, sandbox_budget=data["sandbox_budget"]
        ),
        BudgetForm,
    ),
    "stop-sandbox": Control(
        "Stop sandbox",
        "Stops the sandbox; a rollout using it loses it and starts again from a snapshot.",
        True,
        lambda user, task_id, node_id, data: sandbox_services.admin_sandbox_stop(
            actor=user, sandbox_id=data["sandbox_id"], task_id=_sandbox_task(user, data["sandbox_id"])
        ),
        SandboxForm,
    ),
}


def _target(task_id: str | None, node_id: int | None) -> dict:
    """What the confirmation page shows about the target; 404 for an unknown one."""
    if task_id is None:
        return {}
    task = Task.objects.filter(pk=task_id).first()
    if task is None:
        raise Http404(f"Unknown task '{task_id}'.")
    out = {"task": task}
    if node_id is not None:
        node = Node.objects.defer("file_times").filter(task_id=task_id, pk=node_id).first()
        if node is None:
            raise Http404(f"Task '{task_id}' has no node {node_id}.")
        out["node"] = node
        out["node_label"] = selectors.call_label(node.call)
        out["subtree"] = selectors.subtree_size(task_id=task_id, node_id=node_id)
        out["live_snapshot"] = node.snapshots.filter(status=Snapshot.Status.LIVE).first()
    else:
        out["nodes"] = task.nodes.count()
        out["live_snapshots"] = task.snapshots.filter(status=Snapshot.Status.LIVE).count()
    return out


def _next_url(request, task_id: str | None, node_id: int | None, action: str) -> str:
    candidate = request.POST.get("next") or request.GET.get("next") or ""
    if candidate and url_has_allowed_host_and_scheme(candidate, {request.get_host()}, request.is_secure()):
        return candidate
    if task_id is None:
        return reverse("dashboard:pools")
    if node_id is not None and action not in ("evict-subtree",):
        return reverse("dashboard:node", args=[task_id, node_id])
    return reverse("dashboard:task", args=[task_id])


@require_http_methods(["GET", "POST"])
@controller_required
def control(request, action: str, task_id: str | None = None, node_id: int | None = None):
    spec = CONTROLS.get(action)
    if spec is None:
        raise Http404(f"Unknown action '{action}'.")
    target = _target(task_id, node_id)
    next_url = _next_url(request, task_id, node_id, action)
    initial = {"sandbox_id": request.GET.get("sandbox_id", "")}
    if "task" in target:
        initial["sandbox_budget"] = target["task"].sandbox_budget
    form = spec.form(request.POST or None, initial=initial) if spec.form else None
    status = 200
    if request.method == "POST":
        form_ok = form is None or form.is_valid()
        if request.POST.get("confirm") == "yes" and form_ok:
            data = form.cleaned_data if form is not None else {}
            try:
                entry = spec.run(request.user, task_id, node_id, data)
            except ApplicationError as exc:
                messages.error(request, f"{spec.title} refused: {exc.message}")
            else:
                messages.success(request, f"{spec.title}: done ({entry.target}). See the audit log.")
            return redirect(next_url)
        status = 400  # not confirmed, or an invalid form: show the confirmation again
    return render(
        request,
        "dashboard/confirm.html",
        {
            "spec": spec,
            "action": action,
            "task_id": task_id,
            "node_id": node_id,
            "form": form,
            "next": next_url,
            **target,
        },
        status=status,
    )
