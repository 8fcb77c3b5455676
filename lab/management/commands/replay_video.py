"""Replay EgoSchema-shaped rollouts over generated long videos (frame sampling, captioning, clip
retrieval and extraction, notes, an answer) through tvcache in client mode and without cache,
side by side; then one video's group through tinker-cookbook's own rollout loop, uncached and
through tvclient.integrations.tinker (--tinker-group 0 skips it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from django.core.management.base import CommandError

from lab.replay.command import ReplayCommand
from lab.replay.video.figures import video_table
from lab.replay.video.tinker import TinkerCheckFailed, tinker_group, tinker_line
from lab.replay.video.workload import VideoWorkload


class Command(ReplayCommand):
    help = __doc__
    workload_name = "video"
    # The service's backends run bash, SQL and file tools, not a trainer's Python tools.
    default_arms = "nocache,client"

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument(
            "--latency-scale",
            type=float,
            default=1.0,
            help="times the tools' fixed latencies (sample_frames 300 ms, caption_frames 800 ms, ...)",
        )
        parser.add_argument(
            "--tinker-group",
            type=int,
            default=4,
            help="samples of the group run through Tinker's do_group_rollout (video 0, epoch 0); 0: skip",
        )

    def handle(self, *args, **options):
        if any(arm.strip().startswith("server") for arm in options["arms"].split(",")):
            self.stderr.write("the video tools are Python functions the service cannot run: no tool-server arm")
            options["arms"] = ",".join(a for a in options["arms"].split(",") if not a.strip().startswith("server"))
        began = time.time()
        super().handle(*args, **options)
        path = self._report_path(Path(options["out"]), began)
        report = json.loads(path.read_text())
        self.stdout.write(video_table(report))
        if options["tinker_group"] <= 0:
            return
        try:
            with self._service(options, Path(options["out"])) as (url, token, _):
                report["tinker"] = tinker_group(
                    url=url,
                    token=token,
                    seed=options["seed"],
                    group_size=options["tinker_group"],
                    latency_scale=options["latency_scale"],
                )
        except TinkerCheckFailed as exc:
            raise CommandError(str(exc)) from exc
        path.write_text(json.dumps(report, indent=1, default=str))
        self.stdout.write(tinker_line(report["tinker"]))
        if not report["tinker"]["identical"]:
            raise CommandError(f"Tinker's rollouts through tvcache differ from the uncached ones: {path}")

    @staticmethod
    def _report_path(out_dir: Path, since: float) -> Path:
        """The report this run wrote (ReplayCommand names it by its start time)."""
        written = [p for p in out_dir.glob("video-*.json") if p.stat().st_mtime >= since]
        if not written:
            raise CommandError(f"no video report written in {out_dir}")
        return max(written, key=lambda p: p.stat().st_mtime)

    def make_workload(self, options):
        return VideoWorkload(
            tasks=options["tasks"],
            rollouts=options["rollouts"],
            seed=options["seed"],
            latency_scale=options["latency_scale"],
        )

    def workload_config(self, options):
        return {"latency_scale": options["latency_scale"], "tinker_group": options["tinker_group"]}
