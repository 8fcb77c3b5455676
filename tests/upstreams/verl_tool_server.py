"""A verl-tool-shaped tool server for the tests, on loopback: the same request and response
shapes as verl-tool's FastAPI server (verl_tool/servers/tool_server.py), written for the tests.

- `POST /get_observation` takes `trajectory_ids`, `actions` and the optional `extra_fields`,
  `finish` and `is_last_step` lists; `finish` and `is_last_step` are added to each item's extra
  fields unless they have them. It answers `observations`, `dones`, `valids`,
  `processing_time_ms` and `queue_time_ms`; a request without ids or actions gets 422.
- Tools, chosen per action as verl-tool does (finish first, then the first tool that parses it):
  - `calc` (stateless): `<calc>EXPR</calc>`, integer arithmetic; the observation is a string.
  - `bash` (stateful): `<bash>COMMAND</bash>` runs real bash in a folder of the trajectory's own,
    which lives until the trajectory's finish; the observation is `{"obs": output, "exit_code"}`,
    with a reminder of `turns_left` from the extra fields (as verl-tool's sql tool writes one).
    Every action is kept in the trajectory's env, invalid ones too (as verl-tool's tools do), and
    counted in the folder's `.turns`; an empty command is answered invalid; `crash` makes the
    tool raise.
  - `finish`: drops the trajectory's env; observes what is in \\boxed{...}; done, valid.
  - no tool: `{"obs": "", "invalid_reason": ...}`, not valid, not done.
  A tool that raises answers `{"obs": "", "error": "Tool processing failed: ..."}`, done, not
  valid, as verl-tool's server does.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
BASH = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)
BOXED = re.compile(r"\\boxed\{(.+?)\}", re.DOTALL)
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only integer arithmetic")


class ToolFailure(Exception):
    pass


class VerlToolServer:
    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="verl-tool-"))
        self.envs: dict[str, dict] = {}  # trajectory id -> {"dir": Path, "actions": [...]}
        self.requests: list[dict] = []  # every request body received, in order
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_observation"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # What the tests look at.

    def actions_received(self, trajectory_id: str) -> list[str]:
        with self.lock:
            return [
                action
                for body in self.requests
                for tid, action in zip(body["trajectory_ids"], body["actions"])
                if tid == trajectory_id
            ]

    def request_count(self) -> int:
        with self.lock:
            return len(self.requests)

    # The protocol.

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                arrived = time.perf_counter()
                if self.path != "/get_observation":
                    return self._reply(404, {"detail": "Not Found"})
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if (
                    not body.get("trajectory_ids")
                    or not body.get("actions")
                    or len(body["trajectory_ids"]) != len(body["actions"])
                ):
                    return self._reply(
                        422, {"detail": "trajectory_ids and actions must be non-empty lists of one length"}
                    )
                with server.lock:
                    server.requests.append(body)
                started = time.perf_counter()
                observations, dones, valids = server.process(body)
                self._reply(
                    200,
                    {
                        "observations": observations,
                        "dones": dones,
                        "valids": valids,
                        "processing_time_ms": (time.perf_counter() - started) * 1000,
                        "queue_time_ms": (started - arrived) * 1000,
                    },
                )

            def _reply(self, status: int, data: dict):
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler

    def process(self, body: dict) -> tuple[list, list, list]:
        ids, actions = [str(t) for t in body["trajectory_ids"]], body["actions"]
        extra_fields = [dict(e or {}) for e in body.get("extra_fields") or [{} for _ in ids]]
        for key in ("finish", "is_last_step"):
            if body.get(key) is not None:
                for extra, value in zip(extra_fields, body[key]):
                    extra.setdefault(key, value)
        answers = []
        for trajectory_id, action, extra in zip(ids, actions, extra_fields):
            try:
                answers.append(self._act(trajectory_id, action, extra))
            except ToolFailure as exc:
                answers.append(({"obs": "", "error": f"Tool processing failed: {exc}"}, True, False))
        return [a[0] for a in answers], [a[1] for a in answers], [a[2] for a in answers]

    def _act(self, trajectory_id: str, action: str, extra: dict):
        if extra.get("finish"):
            self._drop(trajectory_id)
            boxed = BOXED.search(action)
            return (boxed.group(1).strip() if boxed else ""), True, True
        if BASH.search(action):
            return self._bash(trajectory_id, BASH.search(action).group(1).strip(), extra)
        if CALC.search(action):
            try:
                value = _evaluate(ast.parse(CALC.search(action).group(1).strip(), mode="eval"))
            except (SyntaxError, ValueError, ZeroDivisionError) as exc:
                return f"\n<result>error: {exc}</result>\n", False, True
            return f"\n<result>{value}</result>\n", False, True
        return {"obs": "", "invalid_reason": "no valid tool found for action"}, False, False

    def _bash(self, trajectory_id: str, command: str, extra: dict):
        with self.lock:
            env = self.envs.setdefault(
                trajectory_id, {"dir": self.root / f"t{len(self.envs)}-{time.monotonic_ns()}", "actions": []}
            )
        env["dir"].mkdir(exist_ok=True)
        env["actions"].append(command)  # kept, valid or not, and counted where the commands can read it
        (env["dir"] / ".turns").write_text(f"{len(env['actions'])}\n")
        reminder = f"<reminder>You have {extra.get('turns_left', 0)} turns left.</reminder>"
        if not command:
            return {"obs": f"Your previous action is invalid: the command is empty.\n{reminder}"}, False, False
        if command == "crash":
            raise ToolFailure("the bash session died")
        done = subprocess.run(["bash", "-c", command], cwd=env["dir"], capture_output=True, text=True, timeout=30)
        return {"obs": f"{done.stdout}{done.stderr}\n{reminder}", "exit_code": done.returncode}, False, True

    def _drop(self, trajectory_id: str):
        with self.lock:
            env = self.envs.pop(trajectory_id, None)
        if env is not None:
            shutil.rmtree(env["dir"], ignore_errors=True)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def verl_tool_server():
    server = VerlToolServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.close()
