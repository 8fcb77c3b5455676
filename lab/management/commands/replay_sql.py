"""Replay read-only query rollouts over generated SQLite databases: client mode, tool-server mode
(sqlite backend) and no cache side by side; a configurable latency models a remote database."""

from lab.replay.command import ReplayCommand
from lab.replay.sql import SqlWorkload


class Command(ReplayCommand):
    help = __doc__
    workload_name = "sql"
    default_tasks = 4
    default_concurrency = 8

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument(
            "--latency-ms",
            type=float,
            default=50.0,
            help="added per executed query (remote database); hits pay nothing",
        )
        parser.add_argument("--rows", type=int, default=1500, help="orders per database")

    def make_workload(self, options):
        return SqlWorkload(
            tasks=options["tasks"],
            rollouts=options["rollouts"],
            seed=options["seed"],
            latency_ms=options["latency_ms"],
            rows=options["rows"],
        )

    def workload_config(self, options):
        return {"latency_ms": options["latency_ms"], "rows": options["rows"]}
