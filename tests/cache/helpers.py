def call(tool: str, **args) -> dict:
    return {"tool": tool, "args": args}


def lookup(api, task, history, c, **extra):
    response = api.post(f"/api/v1/tasks/{task}/lookup", {"history": history, "call": c, **extra}, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def record(api, task, history, c, result, exec_ms=10.0, **extra):
    response = api.post(f"/api/v1/tasks/{task}/record",
                        {"history": history, "call": c, "result": result, "exec_ms": exec_ms, **extra}, format="json")
    assert response.status_code == 200, response.content
    return response.json()


PROJECTS = ("alpha", "beta")
ROLES = ("trainer", "maintainer")


def project_clients(projects=PROJECTS, roles=ROLES) -> dict[tuple[str, str], "APIClient"]:
    """An API client per (project, role), each with a token of its own ("<project>-<role>")."""
    from rest_framework.test import APIClient

    from cache.api.auth import token_create

    clients = {}
    for project in projects:
        for role in roles:
            client = APIClient()
            client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(name=f'{project}-{role}', project=project, role=role)}")
            clients[project, role] = client
    return clients
