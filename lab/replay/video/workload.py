"""The video workload: multiple-choice questions over generated long videos (EgoSchema-shaped).

Each task is a video: a folder of a few hundred frames (footage.py) and a question with five
options. Its rollouts (policy.py) call the video tools (tools.py), which run in a copy of the
folder per sandbox with fixed latencies. Client mode only, like bfcl: the service's backends run
bash, SQL and file tools, not a trainer's Python tool functions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tvclient import ToolExecutionEnvironment

from ..samples import EpochRun
from ..workload import VERIFY_STEP, Call, ReplayTask, Workload
from .figures import Transcript, video_figures
from .footage import Footage, generate
from .policy import VideoPolicy
from .tools import TOOLS, TOOLS_VERSION, run_tool, tokens
from .tools import answer as answer_tool


def _copy_or_link(source: str, target: str) -> None:
    """Copies share the frames, which no tool writes (as containers share an image's layers), and
    copy everything else: clips and notes are written in place."""
    if Path(source).parent.name == "frames":
        os.link(source, target)
    else:
        shutil.copy2(source, target)


class VideoEnvironment(ToolExecutionEnvironment):
    """A copy of the video's folder; fork() copies it again."""

    backend = "video-folder"

    def __init__(self, source: Path, workdir: Path, latency_scale: float):
        self._source = source
        self._workdir = workdir
        self._latency_scale = latency_scale
        self.path: Path | None = None
        self.size_bytes = 0

    def start(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="sandbox-", dir=self._workdir))
        shutil.copytree(self._source, self.path, dirs_exist_ok=True, copy_function=_copy_or_link)

    def execute(self, call: Call) -> dict[str, Any]:
        assert self.path is not None
        return run_tool(self.path, call, self._latency_scale)

    def fork(self) -> VideoEnvironment:
        assert self.path is not None
        twin = VideoEnvironment(self.path, self._workdir, self._latency_scale)
        twin.start()
        twin.size_bytes = sum(p.stat().st_size for p in twin.path.rglob("*") if p.is_file())
        return twin

    def stop(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def mutates_state(self, call: Call) -> bool:
        tool = TOOLS.get(call["tool"])
        return tool is None or not tool.read_only


class VideoWorkload(Workload):
    name = "video"

    def __init__(self, *, tasks: int, rollouts: int, seed: int, latency_scale: float = 1.0):
        self.n_tasks = tasks
        self.n_rollouts = rollouts
        self.seed = seed
        self.latency_scale = latency_scale
        self._dir = Path(tempfile.mkdtemp(prefix="tvcache-replay-video-"))
        self._footage: dict[str, Footage] = {}
        self._policies: dict[str, VideoPolicy] = {}
        self._tasks: list[ReplayTask] | None = None
        self._transcripts: dict[tuple[str, int], Transcript] = {}

    def describe(self) -> dict[str, Any]:
        return {
            "latency_scale": self.latency_scale,
            "tools": {
                name: {"latency_ms": t.latency_ms, "read_only": t.read_only, "generates_text": t.generates_text}
                for name, t in TOOLS.items()
            },
            "tools_version": TOOLS_VERSION,
            "frames": {name: len(f.frames) for name, f in self._footage.items()},
            "token_rule": "ceil(characters / 4) of the answer as the policy reads it (its JSON text)",
        }

    def tasks(self) -> list[ReplayTask]:
        if self._tasks is None:
            self._tasks = [self._task(index) for index in range(self.n_tasks)]
        return self._tasks

    def _task(self, index: int) -> ReplayTask:
        footage = generate(self.seed, index)
        source = self._dir / footage.video
        footage.write(source)
        self._footage[footage.video] = footage
        self._policies[footage.video] = VideoPolicy(footage, self.seed)
        tools = {name: {"mutates_state": not t.read_only, "cacheable": True} for name, t in TOOLS.items()}
        client_env = {
            "backend": "external",
            "workload": "video",
            "video": footage.video,
            "footage": footage.digest(),
            "tools_version": TOOLS_VERSION,
        }

        def make_env() -> ToolExecutionEnvironment:
            return VideoEnvironment(source, self._dir, self.latency_scale)

        return ReplayTask(footage.video, tools, client_env, None, make_env)

    def rollouts(self, task: ReplayTask, epoch: int) -> list[list[Call]]:
        policy = self._policies[task.name]
        return [policy.rollout(epoch, index) for index in range(self.n_rollouts)]

    def steps(self, task: ReplayTask, epoch: int) -> list[list[str | None]]:
        """The answer is the task's verifier: it computes the reward."""
        return [
            [VERIFY_STEP if call["tool"] == answer_tool.__name__ else None for call in calls]
            for calls in self.rollouts(task, epoch)
        ]

    def transcript(self, task: str, epoch: int) -> Transcript:
        """Every call's answer of the epoch's rollouts of `task`, run again without latencies in
        fresh folders: its length in tokens, and whether the rollout answered right."""
        if (task, epoch) not in self._transcripts:
            self._transcripts[(task, epoch)] = self._transcribe(task, epoch)
        return self._transcripts[(task, epoch)]

    def _transcribe(self, task: str, epoch: int) -> Transcript:
        task_row = next(t for t in self.tasks() if t.name == task)
        lengths, right = [], []
        for calls in self.rollouts(task_row, epoch):
            env = VideoEnvironment(self._dir / task, self._dir, 0.0)
            env.start()
            try:
                results = [env.execute(call) for call in calls]
            finally:
                env.stop()
            lengths.append([tokens(result) for result in results])
            answers = [r for c, r in zip(calls, results) if c["tool"] == answer_tool.__name__]
            right.append(bool(answers) and answers[-1].get("correct") is True)
        return Transcript(lengths, right)

    def figures(self, runs: list[EpochRun]) -> dict[str, Any]:
        return video_figures(runs, self.transcript, {name for name, t in TOOLS.items() if t.generates_text})

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
