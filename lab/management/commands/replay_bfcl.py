"""Replay rollouts of BFCL multi-turn tasks (bfcl-eval's stateful Python tools) through tvcache in
client mode, and without cache, side by side. `--calibrate` regenerates the annotation of which
tools mutate state (lab/replay/data/bfcl_tool_effects.json) instead."""

import json

from lab.replay.bfcl import EFFECTS_PATH, BfclWorkload, calibrate
from lab.replay.command import ReplayCommand


class Command(ReplayCommand):
    help = __doc__
    workload_name = "bfcl"
    default_tasks = 200
    # The service runs no Python tool classes: no tool-server mode for this workload.
    default_arms = "nocache,client"
    default_concurrency = 8

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--calibrate", action="store_true", help="rewrite the tool-effects annotation and exit")

    def handle(self, *args, **options):
        if options["calibrate"]:
            effects = calibrate(seed=options["seed"])
            EFFECTS_PATH.parent.mkdir(parents=True, exist_ok=True)
            EFFECTS_PATH.write_text(json.dumps(effects, indent=1) + "\n")
            read_only = [t for t, row in effects["tools"].items() if not row["mutates_state"]]
            self.stdout.write(f"{len(effects['tools'])} tools, {len(read_only)} read-only: {EFFECTS_PATH}")
            return
        if any(arm.strip().startswith("server") for arm in options["arms"].split(",")):
            self.stderr.write("bfcl tools are Python classes the service cannot run: no tool-server arm")
            options["arms"] = ",".join(a for a in options["arms"].split(",") if not a.strip().startswith("server"))
        super().handle(*args, **options)

    def make_workload(self, options):
        return BfclWorkload(tasks=options["tasks"], rollouts=options["rollouts"], seed=options["seed"])
