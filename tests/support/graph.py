"""A small task graph of a few levels, recorded through the API (the dashboard's tests), and the
password of the dashboard tests' users."""

from __future__ import annotations

from tests.support.api import call, lookup, record

PASSWORD = "correct horse battery staple"

CLONE = call("bash", command="git clone repo")
MAKE = call("bash", command="make")
READ = call("read", path="foo.py")
TEST = call("bash", command="pytest -q")
PATCH = call("bash", command="patch -p1 < fix.diff")
RETEST = call("bash", command="pytest -q tests/test_fix.py")
LS = call("bash", command="ls -la")


def build_tree(api, task: str) -> dict[str, int]:
    """clone ─┬─ make ─┬─ read foo.py (read-only)
              │        └─ pytest ── patch ── pytest tests/test_fix.py
              └─ ls
    with client snapshots on pytest and patch, and a few lookups (hits and misses) by two rollouts."""
    ids = {}
    steps = [
        ("clone", [], CLONE, 900.0),
        ("make", [CLONE], MAKE, 4000.0),
        ("read", [CLONE, MAKE], READ, 5.0),
        ("test", [CLONE, MAKE], TEST, 12000.0),
        ("patch", [CLONE, MAKE, TEST], PATCH, 30.0),
        ("retest", [CLONE, MAKE, TEST, PATCH], RETEST, 3000.0),
        ("ls", [CLONE], LS, 8.0),
    ]
    for name, history, c, ms in steps:
        result = {"stdout": f"output of {c['args']}\n" * 3, "stderr": "", "exit_code": 0, "timed_out": False}
        if name == "read":
            result = {"output": "line\n" * 200, "ok": True}
        ids[name] = record(api, task, history, c, result, exec_ms=ms, rollout_id="r0", epoch=0)["node_id"]
    for name, ref in (("test", "snap-test"), ("patch", "snap-patch")):
        response = api.post(
            f"/api/v1/tasks/{task}/nodes/{ids[name]}/snapshots",
            {"ref": ref, "backend": "external", "size_bytes": 50_000_000, "create_ms": 120.0},
            format="json",
        )
        assert response.status_code == 201, response.content
    for rollout, epoch in (("r1", 0), ("r2", 1)):
        lookup(api, task, [], CLONE, rollout_id=rollout, epoch=epoch)
        lookup(api, task, [CLONE], MAKE, rollout_id=rollout, epoch=epoch)
        lookup(api, task, [CLONE, MAKE], call("bash", command="make install"), rollout_id=rollout, epoch=epoch)
    return ids
