"""Django admin: the cache's tables, read-only, with the dashboard's staff actions as admin actions.
Every action goes through the same audited services (`cache.services.admin`) after a confirmation
page; editing rows directly is disabled, so nothing changes without an audit entry.

Projects (their grants and members) and API tokens are the operator's configuration and are
edited here (as with `manage.py project_set`, `create_token`, `revoke_token`): a new token's key is
shown once, on the page that follows its creation; only its digest is stored."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import ValidationError
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from cache import services
from cache.api.auth import TOKEN_CACHE_TTL_S, key_digest, new_key
from cache.errors import ApplicationError
from cache.models import ApiToken, AuditEntry, Membership, Node, Project, Snapshot, Task
from cache.services.projects import LIMITS, check_grants

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


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ("user",)


class ProjectForm(forms.ModelForm):
    class Meta:
        model = Project
        exclude = ("members",)

    def clean(self):
        data = super().clean()
        grants = {field: data.get(field) for field in ("network", "images", *LIMITS) if field in data}
        try:
            check_grants(grants)
        except ApplicationError as exc:
            field = (exc.details or {}).get("field") if isinstance(exc.details, dict) else None
            raise ValidationError({field: exc.message} if field in self.fields else exc.message) from None
        return data


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    form = ProjectForm
    list_display = ("name", "network", "max_live_sandboxes", "max_snapshot_bytes", "rate_limit", "created_at", "usage")
    search_fields = ("name",)
    readonly_fields = ("created_at",)
    inlines = (MembershipInline,)
    fieldsets = (
        (None, {"fields": ("name", "created_at")}),
        (
            "Docker grants (within the service's maxima, TVCACHE_DOCKER_*)",
            {"fields": ("network", "images", "max_memory_mb", "max_cpus", "max_pids")},
        ),
        ("Quotas", {"fields": ("max_live_sandboxes", "max_snapshot_bytes", "rate_limit", "rate_burst")}),
    )

    @admin.display(description="usage")
    def usage(self, project):
        return format_html('<a href="{}">usage and tokens</a>', reverse("dashboard:project", args=[project.name]))

    def has_delete_permission(self, request, obj=None):
        return False  # a project owns tasks and tokens; it is not deleted from here


class ApiTokenForm(forms.ModelForm):
    class Meta:
        model = ApiToken
        fields = ("name", "project", "role", "expires_at")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Create (the key is shown once), change role or expiry, revoke. Revocation and expiry take
    effect in every server process within TOKEN_CACHE_TTL_S."""

    form = ApiTokenForm
    list_display = ("name", "project", "role", "state", "last_used_at", "expires_at", "created_at")
    list_filter = ("role", "project")
    search_fields = ("name",)
    actions = ("revoke",)

    def get_readonly_fields(self, request, obj=None):
        return ("name", "project", "created_at", "last_used_at", "revoked_at") if obj is not None else ()

    @admin.display(description="state")
    def state(self, token):
        if token.revoked_at:
            return "revoked"
        return "expired" if token.expires_at and token.expires_at <= timezone.now() else "active"

    def save_model(self, request, obj, form, change):
        if not change:
            key = new_key()
            obj.key_digest = key_digest(key)
            super().save_model(request, obj, form, change)
            self.message_user(
                request,
                format_html(
                    "Token <b>{}</b> of project <b>{}</b> ({}): <code>{}</code> &mdash; copy it now, it is not shown again.",
                    obj.name,
                    obj.project,
                    obj.role,
                    key,
                ),
                messages.WARNING,
            )
            return
        super().save_model(request, obj, form, change)

    @admin.action(description=f"Revoke selected tokens (refused within {TOKEN_CACHE_TTL_S:.0f} s)")
    def revoke(self, request, queryset):
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} token(s).", messages.SUCCESS)

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead: the name stays taken and the record says when


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
