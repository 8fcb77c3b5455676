"""Replay terminal-bench-like docker rollouts (C build, Python tests, git, config edits) through the
service in tool-server mode and client mode, and without cache, side by side."""

from lab.replay.command import ReplayCommand
from lab.replay.terminal import TerminalWorkload


class Command(ReplayCommand):
    help = __doc__
    workload_name = "terminal"
    default_tasks = 4
    default_arms = "nocache,server,client"
    default_concurrency = 4

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--task-names", default="", help="comma-separated task names instead of the first --tasks")
        parser.add_argument(
            "--direct-calls",
            choices=("exec", "session"),
            default="exec",
            help="how the lab's own containers (the no-cache arm, client mode, fresh executions) run "
            "a call: a docker exec each, as a trainer's own containers do, or the session agent "
            "that tool-server mode uses",
        )

    def make_workload(self, options):
        names = [n.strip() for n in options["task_names"].split(",") if n.strip()]
        return TerminalWorkload(
            tasks=options["tasks"],
            rollouts=options["rollouts"],
            seed=options["seed"],
            names=names,
            direct_calls=options["direct_calls"],
        )

    def workload_config(self, options):
        return {"task_names": options["task_names"], "direct_calls": options["direct_calls"]}
