"""Who sees and controls what on the dashboard: staff see and control every project; other users
see the projects they are members of, and control those where they are maintainers (the roles of
tokens, accounts.projects). Another project's task, node or sandbox is a 404, as in the API."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.urls import register_converter

from accounts.models import Membership, Project
from accounts.projects import MAINTAINER, key_project, role_allows


class TaskKeyConverter:
    """A task's key in a URL: its id, or `<project>.<id>` outside the default project."""

    regex = r"[-a-zA-Z0-9_]+(?:\.[-a-zA-Z0-9_]+)?"

    def to_python(self, value: str) -> str:
        return value

    def to_url(self, value: str) -> str:
        return value


register_converter(TaskKeyConverter, "taskkey")


def roles(user) -> dict[str, str] | None:
    """{project name: role} of the user's projects; None for staff (every project, maintainer)."""
    if user.is_staff:
        return None
    cached = getattr(user, "_tvcache_roles", None)
    if cached is None:
        cached = dict(Membership.objects.filter(user=user).values_list("project__name", "role"))
        user._tvcache_roles = cached  # once per request
    return cached


def visible_projects(user) -> list[Project]:
    """The projects the user sees, by name."""
    mine = roles(user)
    projects = Project.objects.order_by("name")
    return list(projects if mine is None else projects.filter(name__in=mine))


def project_role(user, project: str) -> str | None:
    mine = roles(user)
    return MAINTAINER if mine is None else mine.get(project)


def can_see(user, project: str) -> bool:
    return project_role(user, project) is not None


def can_control(user, project: str) -> bool:
    role = project_role(user, project)
    return role is not None and role_allows(role, write=True)


def project_check(user, project: str, *, write: bool = False) -> None:
    """404 for a project the user does not see; 403 for a change a trainer member asks for."""
    if not can_see(user, project):
        raise Http404("No such project.")
    if write and not can_control(user, project):
        raise PermissionDenied("Maintainers of this project and staff only.")


def task_check(user, task_key: str, *, write: bool = False) -> None:
    project_check(user, key_project(task_key), write=write)
