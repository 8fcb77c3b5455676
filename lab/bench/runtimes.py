"""Measurements behind `manage.py bench_runtimes`: the same docker backend calls under each OCI
runtime (runc, gVisor's runsc), interleaved round by round so that load on the machine weighs on
both alike. Per runtime and image:

- start: `DockerBackend.start` (create + start + the shell session's first state);
- call: a bash call in a running sandbox, plain (`execute`: a replay) and as a tool-server miss
  runs it (`execute_observed`: the state observed before and after);
- snapshot: `snapshot()` of a sandbox holding a state with live processes (a web server, a
  background process, one process holding `memory_mb` of memory): a commit under runc, a
  checkpoint plus a commit under runsc; its time and its size on disk (the layer plus, under runsc,
  the checkpoint, which holds the processes' memory);
- fork: `fork()` of that snapshot, then its first call (a probe of the server and the background
  process: under runsc they answer, under runc they are gone);
- memory: what a fork's container uses once it answered (the engine's stats).
"""

from __future__ import annotations

from typing import Any

from lab.bench.sandboxes import summary, timed_ms

RUNTIMES = ("runc", "runsc")
CALLS = ("true", "echo hi > f")
# The state a snapshot is taken of: a daemonized web server, a background process, and a shell
# holding about MEMORY bytes of random text in a variable (base64: a checkpoint compresses memory),
# all left running by the call. The shell loops so that it is not replaced by its last command.
SETUP = (
    "mkdir -p /www && echo page > /www/index.html && busybox httpd -p 8089 -h /www && "
    "(sleep 100000 >/dev/null 2>&1 &) && "
    "(v=$(head -c {memory} /dev/urandom | base64); touch /held; while :; do sleep 100000; done) >/dev/null 2>&1 & "
    "while [ ! -e /held ]; do sleep 0.1; done; echo started"
)
PROBE = "wget -qO- http://127.0.0.1:8089/ 2>/dev/null || echo unreachable; ps -o args | grep -c '^sleep 100000'"


def env_for(runtime: str, image: str) -> dict[str, Any]:
    return {"backend": "docker", "image": image, "runtime": runtime}


def starts(backend, image: str, labels: dict[str, str], rounds: int) -> dict[str, Any]:
    """Start latency per runtime (stopped again at once)."""
    found: dict[str, list[float]] = {runtime: [] for runtime in RUNTIMES}
    for i in range(rounds):
        for runtime in _order(i):
            ms, sandbox = timed_ms(lambda: backend.start(env_for(runtime, image), labels=labels))
            found[runtime].append(ms)
            sandbox.stop()
    return {"image": image, **{runtime: summary(values) for runtime, values in found.items()}}


def calls(backend, image: str, labels: dict[str, str], rounds: int) -> dict[str, Any]:
    """Call latency per runtime and command, plain and observed as a tool-server miss runs it."""
    sandboxes = {runtime: backend.start(env_for(runtime, image), labels=labels) for runtime in RUNTIMES}
    found: dict[str, dict[str, list[float]]] = {runtime: {"first": []} for runtime in RUNTIMES}
    try:
        for runtime, sandbox in sandboxes.items():
            found[runtime]["first"].append(timed_ms(lambda: sandbox.execute_observed("bash", {"command": "true"}))[0])
        for i in range(rounds):
            for command in CALLS:
                for observed in (False, True):
                    for runtime in _order(i):
                        sandbox = sandboxes[runtime]
                        ms, result = timed_ms(
                            lambda: (sandbox.execute_observed if observed else sandbox.execute)(
                                "bash", {"command": command}
                            )
                        )
                        result = result[0] if observed else result
                        if result["exit_code"] != 0:
                            raise RuntimeError(f"{runtime}: {command!r} answered {result}")
                        found[runtime].setdefault(f"{command} ({'observed' if observed else 'plain'})", []).append(ms)
    finally:
        for sandbox in sandboxes.values():
            sandbox.stop()
    return {
        "image": image,
        **{runtime: {name: summary(v) for name, v in values.items()} for runtime, values in found.items()},
    }


def snapshots_and_forks(backend, image: str, labels: dict[str, str], memory_mb: int, rounds: int) -> dict[str, Any]:
    """Per runtime: snapshot a sandbox holding live processes, fork it, probe the fork; what the
    fork's container uses. The source's own next call is timed too (under runsc it was restored
    from its checkpoint)."""
    figures: dict[str, dict[str, list[float]]] = {
        r: {"snapshot": [], "size_mb": [], "fork": [], "first_call": [], "source_next_call": [], "fork_memory_mb": []}
        for r in RUNTIMES
    }
    answers: dict[str, set[str]] = {r: set() for r in RUNTIMES}
    keeps: dict[str, set[bool]] = {r: set() for r in RUNTIMES}
    setup = SETUP.format(memory=memory_mb * 750_000)  # base64: 4 bytes of text per 3
    for i in range(rounds):
        for runtime in _order(i):
            env = env_for(runtime, image)
            with backend.start(env, labels=labels) as source:
                result = source.execute("bash", {"command": setup})
                if result["stdout"] != "started\n":
                    raise RuntimeError(f"{runtime}: the setup answered {result}")
                ms, info = timed_ms(lambda: source.snapshot(labels=labels))
                figures[runtime]["snapshot"].append(ms)
                figures[runtime]["size_mb"].append(info.size_bytes / 1e6)
                keeps[runtime].add(info.keeps_processes)
                figures[runtime]["source_next_call"].append(
                    timed_ms(lambda: source.execute("bash", {"command": "true"}))[0]
                )
            try:
                ms, fork = timed_ms(lambda: backend.fork(info.ref, env, labels=labels))
                with fork:
                    figures[runtime]["fork"].append(ms)
                    ms, probe = timed_ms(lambda: fork.execute("bash", {"command": PROBE}))
                    figures[runtime]["first_call"].append(ms)
                    answers[runtime].add(" ".join(probe["stdout"].split()))
                    figures[runtime]["fork_memory_mb"].append(_memory_mb(backend, fork.sandbox_id))
            finally:
                backend.delete_snapshot(info.ref)
    out: dict[str, Any] = {"image": image, "memory_mb": memory_mb}
    for runtime, values in figures.items():
        out[runtime] = {
            "snapshot": summary(values["snapshot"]),
            "fork": summary(values["fork"]),
            "fork_and_first_call": summary([f + c for f, c in zip(values["fork"], values["first_call"])]),
            "source_next_call": summary(values["source_next_call"]),
            "size_mb": _median(values["size_mb"]),
            "fork_memory_mb": _median(values["fork_memory_mb"]),
            "keeps_processes": sorted(keeps[runtime]),
            "fork_probe": sorted(answers[runtime]),
        }
    return out


def _memory_mb(backend, container_id: str) -> float:
    stats = backend.api.stats(container_id, stream=False)
    memory = stats.get("memory_stats") or {}
    cache = (memory.get("stats") or {}).get("cache", 0)  # page cache of the image's files: not the sandbox's own
    return round(max(memory.get("usage", 0) - cache, 0) / 1e6, 1)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 2)


def _order(i: int) -> tuple[str, ...]:
    """The runtime that goes first alternates each round."""
    return RUNTIMES if i % 2 == 0 else tuple(reversed(RUNTIMES))
