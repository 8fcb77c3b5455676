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
