"""Django admin: projects (their grants and members) and API tokens, the operator's configuration,
edited here as with `manage.py project_set`, `create_token` and `revoke_token`. A new token's key is
shown once, on the page that follows its creation; only its digest is stored."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from accounts.models import ApiToken, Membership, Project
from accounts.services.projects import LIMITS, check_grants
from accounts.services.tokens import TOKEN_CACHE_TTL_S, key_digest, new_key
from core.errors import ApplicationError


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
        (
            "Retention of its tasks' results (a task's own bounds win; docs/operations/retention.md)",
            {"fields": ("task_max_nodes", "task_max_result_bytes")},
        ),
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
