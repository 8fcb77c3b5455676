"""The video replay: `manage.py replay_video` in a tiny configuration against a live service (all
its arms, then a group through Tinker's do_group_rollout in the tinker venv), and the video tools'
state model on their own. Tests of the harness, not of timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from django.conf import settings
from django.core.management import call_command

from accounts.services.tokens import token_create
from lab.replay.video.footage import generate
from lab.replay.video.tools import TOOLS, render, run_tool
from lab.replay.video.workload import VideoEnvironment, VideoWorkload
from lab.server import service_running


@pytest.fixture
def service(tmp_path):
    with service_running(
        db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, celery=True, beat=False, log_dir=tmp_path
    ) as service:
        yield service.url, token_create(name="replay-video")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_replay_video_has_no_wrong_answer_and_tinker_rollouts_match(service, tmp_path, django_db_blocker):
    url, token = service
    out = tmp_path / "out"
    with django_db_blocker.block():  # with --url the replay talks to the service over HTTP only
        call_command(
            "replay_video",
            url=url,
            token=token,
            tasks=1,
            rollouts=3,
            epochs=2,
            seed=1,
            think_ms=10,
            latency_scale=0.05,
            tinker_group=2,
            no_plots=True,
            out=str(out),
        )
    [path] = out.glob("video-*.json")
    report = json.loads(path.read_text())

    assert report["workload"] == "video"
    assert [arm["name"] for arm in report["arms"]] == ["nocache", "client"]
    for epoch in report["epochs"]:
        client = epoch["arms"]["client"]
        assert client["calls"] == epoch["arms"]["nocache"]["calls"] > 0
        assert client["exact"]["hits_checked"] == client["hits"]
        assert client["exact"]["hits_mismatches"] == client["exact"]["misses_mismatches"] == 0
    assert report["epochs"][1]["arms"]["client"]["service_hit_rate"] > 0
    assert report["targets"]["zero_mismatched_hits"]["met"]
    assert report["targets"]["hit_rate_equals_oracle"]["met"]

    figures = report["workload_figures"]
    client = figures["arms"]["client"]
    assert client["wrong_answers"] == {"hits": 0, "misses": 0, "total": 0}
    assert client["calls"] == figures["arms"]["nocache"]["calls"]
    assert 0 < client["generated_tokens_saved"] <= client["tokens_served_by_hits"] < client["tokens_answered"]
    assert client["tool_time_speedup_x"] > 0
    captions = [row for row in figures["per_tool"].values() if row["generates_text"]]
    assert captions and all(row["mean_tokens"] > 200 for row in captions)  # long answers
    assert set(figures["policy_right_answers"]) == {"0", "1"}

    tinker = report["tinker"]
    assert tinker["identical"], tinker
    uncached, first, repeat = tinker["passes"]
    assert uncached["ran"]["run_command"] == tinker["calls"]  # every tool ran its program
    assert first["identical_to_uncached"] and repeat["identical_to_uncached"]
    assert repeat["executor"]["hits"] == tinker["calls"] and repeat["executor"]["misses"] == 0
    assert "run_command" not in repeat["ran"]  # the repeat ran nothing


def test_a_clip_caption_answers_after_the_clip_its_rollout_cut(tmp_path):
    """caption_clip is read-only but reads what extract_clip wrote: the same call answers
    differently in two sandboxes whose histories cut different windows under one name."""
    workload = VideoWorkload(tasks=1, rollouts=1, seed=3, latency_scale=0.0)
    try:
        [task] = workload.tasks()
        answers = []
        for start in (0, 20):
            env = task.make_env()
            env.start()
            try:
                env.execute({"tool": "extract_clip", "args": {"start_s": start, "end_s": start + 20, "name": "c"}})
                answers.append(env.execute({"tool": "caption_clip", "args": {"name": "c"}}))
                twin = env.fork()  # a snapshot carries the clip
                assert twin.execute({"tool": "caption_clip", "args": {"name": "c"}}) == answers[-1]
                twin.stop()
            finally:
                env.stop()
        assert answers[0] != answers[1]
        assert not task.make_env().mutates_state({"tool": "caption_clip", "args": {"name": "c"}})
        assert task.make_env().mutates_state({"tool": "extract_clip", "args": {}})
        assert task.tools["extract_clip"]["mutates_state"] and not task.tools["caption_clip"]["mutates_state"]
    finally:
        workload.close()


def test_the_tool_program_answers_as_the_tool_does(tmp_path):
    """The Tinker driver's tools run the program in their sandbox: the same bytes as in process."""
    footage = generate(3, 0)
    footage.write(tmp_path)
    env = VideoEnvironment(tmp_path, tmp_path, 0.0)
    env.start()
    try:
        for call in (
            {"tool": "caption_frames", "args": {"start_s": 10, "end_s": 40}},
            {"tool": "answer", "args": {"option": footage.question["answer"]}},
            {"tool": "sample_frames", "args": {"start_s": 0, "end_s": 500, "count": 4}},  # refused
        ):
            done = subprocess.run(
                [sys.executable, "-m", "lab.replay.video.tools", call["tool"], json.dumps(call["args"])],
                cwd=env.path,
                env={"PYTHONPATH": str(settings.BASE_DIR)},
                capture_output=True,
                text=True,
                check=True,
            )
            assert done.stdout == render(run_tool(env.path, call, 0.0))
        assert set(TOOLS) == {
            "video_info",
            "sample_frames",
            "caption_frames",
            "retrieve_clip",
            "extract_clip",
            "caption_clip",
            "annotate",
            "answer",
        }
    finally:
        env.stop()
