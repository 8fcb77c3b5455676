"""Django admin: the cache's tables, read-only, with the dashboard's staff actions as admin actions.
Every action goes through the same audited services (`cache.services.admin`) after a confirmation
page; editing rows directly is disabled, so nothing changes without an audit entry. (Projects and
API tokens are edited in the accounts app's admin.)"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.template.response import TemplateResponse

from cache import services
from cache.models import AuditEntry, Node, Snapshot, Task
from core.errors import ApplicationError

from .controls import BudgetForm


def _confirmed(modeladmin, request, queryset, *, title: str, explain: str, run, form_class=None):
    """Show a confirmation page (with a form if the action takes input); on confirm, run the action
    on each selected row and report what was done and what was refused."""
    confirming = request.POST.get("confirm") == "yes"
    form = form_class(request.POST if confirming else None) if form_class else None
    if confirming and (form is None or form.is_valid()):
        data = form.cleaned_data if form is not None else {}
        done, refused = 0, []
        for obj in queryset:
            try:
                run(request.user, obj, data)
                done += 1
            except ApplicationError as exc:
                refused.append(f"{obj}: {exc.message}")
        if done:
            modeladmin.message_user(request, f"{title}: {done} done (see the audit log).", messages.SUCCESS)
        for line in refused:
            modeladmin.message_user(request, f"{title} refused for {line}", messages.ERROR)
        return None
    return TemplateResponse(
        request,
        "admin/dashboard/confirm_action.html",
        {
            **modeladmin.admin_site.each_context(request),
            "title": f"{title}?",
            "explain": explain,
            "objects": list(queryset[:200]),
            "count": queryset.count(),
            "action": request.POST.get("action", ""),
            "form": form,
            "opts": modeladmin.model._meta,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across") == "1",
        },
    )


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("name", "project", "backend", "sandbox_budget", "short_fingerprint", "updated_at")
    list_filter = ("project",)
    search_fields = ("name",)
    actions = ("flush_tasks", "set_budget")

    @admin.display(description="backend")
    def backend(self, task):
        return (task.env or {}).get("backend", "external")

    @admin.display(description="fingerprint")
    def short_fingerprint(self, task):
        return task.env_fingerprint[:12]

    @admin.action(description="Flush selected tasks (delete their graphs)…")
    def flush_tasks(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Flush tasks",
            explain="Deletes every node, snapshot, rollout and counter of each task; the tasks stay.",
            run=lambda user, task, data: services.admin_task_flush(actor=user, task_id=task.pk),
        )

    @admin.action(description="Change the budget of selected tasks…")
    def set_budget(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Change budget",
            form_class=BudgetForm,
            explain="Sets the budget of live snapshots and enforces it at once (evicting the least useful).",
            run=lambda user, task, data: services.admin_budget_set(
                actor=user, task_id=task.pk, sandbox_budget=data["sandbox_budget"]
            ),
        )


@admin.register(Node)
class NodeAdmin(ReadOnlyAdmin):
    list_display = ("id", "task", "tool", "depth", "mutates", "exec_ms", "hit_count", "pinned", "created_at")
    list_filter = ("pinned", "mutates", "task")
    search_fields = ("tool",)
    show_full_result_count = False
    actions = ("evict_subtrees", "evict_snapshots", "pin_nodes", "unpin_nodes")

    @admin.action(description="Evict subtrees (delete the nodes and their snapshots)…")
    def evict_subtrees(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Evict subtrees",
            explain="Evicts the live snapshots of each node and its descendants and deletes those nodes.",
            run=lambda user, node, data: services.admin_subtree_evict(
                actor=user, task_id=node.task_id, node_id=node.pk
            ),
        )

    @admin.action(description="Evict only the nodes' snapshots…")
    def evict_snapshots(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Evict snapshots",
            explain="Evicts each node's live snapshot; results stay cached.",
            run=lambda user, node, data: services.admin_snapshot_evict(
                actor=user, task_id=node.task_id, node_id=node.pk
            ),
        )

    @admin.action(description="Pin nodes (never evict their snapshots)…")
    def pin_nodes(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Pin nodes",
            explain="Pinned nodes' snapshots are never evicted.",
            run=lambda user, node, data: services.admin_node_pin(
                actor=user, task_id=node.task_id, node_id=node.pk, pinned=True
            ),
        )

    @admin.action(description="Unpin nodes…")
    def unpin_nodes(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset,
            title="Unpin nodes",
            explain="Their snapshots may be evicted again.",
            run=lambda user, node, data: services.admin_node_pin(
                actor=user, task_id=node.task_id, node_id=node.pk, pinned=False
            ),
        )


@admin.register(Snapshot)
class SnapshotAdmin(ReadOnlyAdmin):
    list_display = ("id", "task", "node_id", "ref", "backend", "owner", "status", "size_bytes", "created_at")
    list_filter = ("status", "owner", "backend")
    search_fields = ("ref",)
    actions = ("evict",)

    @admin.action(description="Evict selected live snapshots…")
    def evict(self, request, queryset):
        return _confirmed(
            self,
            request,
            queryset.filter(status=Snapshot.Status.LIVE),
            title="Evict snapshots",
            explain="Evicts each live snapshot (leased ones are refused); results stay cached.",
            run=lambda user, snapshot, data: services.admin_snapshot_evict(
                actor=user, task_id=snapshot.task_id, node_id=snapshot.node_id
            ),
        )


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    list_display = ("at", "actor_name", "action", "project", "target", "outcome")
    list_filter = ("action", "outcome", "project")
    search_fields = ("actor_name", "target", "task_id")
    date_hierarchy = "at"
