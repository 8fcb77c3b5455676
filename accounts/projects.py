"""Projects: who owns a task, and the one check of who may see or change what a project owns.

A task's id is unique within its project. Internally a task is keyed by one string (`Task.pk`,
the varchar every table, statement and lock refers to): the plain id for the `default` project,
so that the data and clients from before projects keep working, and `<project>.<id>` for every
other one. Task ids, like project names, are slugs (letters, digits, `-` and `_`: the API's routes
and inputs accept nothing else), so a key can never be read two ways. The API turns the id of
a request into its key once, at the edge, inside the calling token's project: the same id in two
projects names two tasks with two separate graphs, and another project's task is simply not found.

No Django import: keys, roles and the ownership rule are plain functions (the dashboard, the
admin, the websocket and other apps such as upstreams call the same ones).
"""

from __future__ import annotations

import re

from core.errors import Forbidden

DEFAULT_PROJECT = "default"
SEPARATOR = "."
MAX_PROJECT_NAME = 50
MAX_TASK_ID = 200  # core.inputs.MAX_ID_LENGTH: what a task id may be
MAX_TASK_KEY = MAX_PROJECT_NAME + 1 + MAX_TASK_ID
PROJECT_NAME = re.compile(r"[-a-zA-Z0-9_]{1,50}")

TRAINER, MAINTAINER = "trainer", "maintainer"
ROLES = (TRAINER, MAINTAINER)


def task_key(project: str, task_id: str) -> str:
    """The internal key of task `task_id` of `project` (Task.pk)."""
    return task_id if project == DEFAULT_PROJECT else f"{project}{SEPARATOR}{task_id}"


def task_split(key: str) -> tuple[str, str]:
    """(project name, task id) of an internal key."""
    project, separator, task_id = key.partition(SEPARATOR)
    return (project, task_id) if separator else (DEFAULT_PROJECT, key)


def task_public_id(key: str) -> str:
    """The id the task's owner knows it by (what the API answers with)."""
    return task_split(key)[1]


def key_project(key: str) -> str:
    return task_split(key)[0]


def role_allows(role: str, *, write: bool) -> bool:
    return not write or role == MAINTAINER


def role_check(*, principal, action: str) -> None:
    """Forbidden unless the principal's token has the maintainer role."""
    if not role_allows(principal.role, write=True):
        raise Forbidden(
            f"Only a maintainer token may {action}; this token is a trainer's.",
            code="maintainer_required",
            details={"role": principal.role, "needs": MAINTAINER},
        )
