"""The graph's 404s: a task or a node that is not there, named as its project knows it (a task's
key is its project's, accounts.projects)."""

from __future__ import annotations

from accounts.projects import task_public_id
from core.errors import NotFound


def unknown_task(key: str) -> NotFound:
    """The 404 of a task that is not there, naming it as its project does."""
    task_id = task_public_id(key)
    return NotFound(f"Unknown task '{task_id}'.", code="unknown_task", details={"task_id": task_id})


def unknown_node(key: str, node_id: int) -> NotFound:
    task_id = task_public_id(key)
    return NotFound(
        f"Task '{task_id}' has no node {node_id}.",
        code="unknown_node",
        details={"task_id": task_id, "node_id": node_id},
    )
