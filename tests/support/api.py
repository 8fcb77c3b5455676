import time


def call(tool: str, **args) -> dict:
    return {"tool": tool, "args": args}


def lookup(api, task, history, c, **extra):
    response = api.post(f"/api/v1/tasks/{task}/lookup", {"history": history, "call": c, **extra}, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def record(api, task, history, c, result, exec_ms=10.0, **extra):
    response = api.post(
        f"/api/v1/tasks/{task}/record",
        {"history": history, "call": c, "result": result, "exec_ms": exec_ms, **extra},
        format="json",
    )
    assert response.status_code == 200, response.content
    return response.json()


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s} s")
        time.sleep(0.05)


def waiting_on_locks(db_name: str) -> int:
    """Connections of database `db_name` waiting for a lock."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'", [db_name]
        )
        return cursor.fetchone()[0]


PROJECTS = ("alpha", "beta")
ROLES = ("trainer", "maintainer")


def project_clients(projects=PROJECTS, roles=ROLES) -> dict[tuple[str, str], object]:
    """An API client per (project, role), each with a token of its own ("<project>-<role>")."""
    from rest_framework.test import APIClient

    from accounts.services.tokens import token_create

    clients = {}
    for project in projects:
        for role in roles:
            client = APIClient()
            client.credentials(
                HTTP_AUTHORIZATION=f"Token {token_create(name=f'{project}-{role}', project=project, role=role)}"
            )
            clients[project, role] = client
    return clients
