"""`python manage.py bench_runtimes`: runc against gVisor's runsc on the same docker backend calls
(lab/bench/runtimes.py): container start, call latency, snapshot time and size, fork (restore)
latency with its first call, and a fork's memory, for a sandbox left with a web server, a
background process and a process holding memory.

Figures go to artifacts/bench/runtimes.json and .md, and the tables to docs/results/bench/runtimes.md
(cited by docs/operations/runtimes.md). Needs an engine with both runtimes and its checkpoint API
(.ci/setup.sh configures it). Everything the run creates carries a label of its own and is removed.
Quick smoke run: `python manage.py bench_runtimes --rounds 2 --memory 0`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from lab.bench import runtimes as bench
from lab.bench.sandboxes import BENCH_LABEL, remove_labelled
from lab.figures import median_p95
from sandboxes.backends.config import DockerConfig
from sandboxes.backends.docker import DockerBackend
from sandboxes.images import BUSYBOX_TAG, DEBIAN_TAG


class Command(BaseCommand):
    help = "Benchmark sandbox runtimes: runc against gVisor's runsc (start, call, snapshot, fork, memory)."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--rounds", type=int, default=10, help="samples of starts, snapshots and forks")
        parser.add_argument("--call-rounds", type=int, default=50, help="rounds of calls per command")
        parser.add_argument("--memory", default="0,64", help="MB a process of the snapshotted state holds")
        parser.add_argument("--out", type=Path, default=Path(settings.BASE_DIR) / "artifacts" / "bench")
        parser.add_argument(
            "--docs",
            default=str(Path(settings.BASE_DIR) / "docs" / "results" / "bench"),
            help="where runtimes.md goes for the docs ('' for nowhere)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        backend = DockerBackend(DockerConfig(runtimes=bench.RUNTIMES, checkpoint_runtimes=("runsc",)))
        facts = backend.facts(wanted_runtime="runsc")
        if "runsc" not in facts.runtimes or not facts.checkpoints:
            raise CommandError(
                "the engine lacks runsc or its checkpoint API: run .ci/setup.sh (docs/operations/runtimes.md)"
            )
        run_id = datetime.now().strftime("%Y%m%d%H%M%S")
        labels = {BENCH_LABEL: f"{run_id}-{uuid.uuid4().hex[:8]}"}
        version = backend.api.version()
        figures: dict[str, Any] = {
            "meta": {
                "run": run_id,
                "cpus": os.cpu_count(),
                "rounds": opts["rounds"],
                "call_rounds": opts["call_rounds"],
                "engine": version.get("Version"),
                "runsc_args": list(facts.runtimes["runsc"]),
                "loadavg": {},
            }
        }
        self.loadavg = figures["meta"]["loadavg"]
        try:
            self._section("starts")
            figures["starts"] = [
                bench.starts(backend, image, labels, opts["rounds"]) for image in (BUSYBOX_TAG, DEBIAN_TAG)
            ]
            self._section("calls")
            figures["calls"] = [
                bench.calls(backend, image, labels, opts["call_rounds"]) for image in (BUSYBOX_TAG, DEBIAN_TAG)
            ]
            self._section("snapshots and forks")
            figures["snapshots"] = [
                bench.snapshots_and_forks(backend, BUSYBOX_TAG, labels, int(mb), opts["rounds"])
                for mb in opts["memory"].split(",")
            ]
        finally:
            self._section("cleanup")
            figures["cleanup"] = {"leftover_on_engine": remove_labelled(backend, labels)}
        self._write(opts["out"], opts["docs"], figures)

    def _section(self, title: str) -> None:
        self.loadavg[title] = round(os.getloadavg()[0], 2)
        self.stdout.write(f"[{time.strftime('%H:%M:%S')}] {title} (load {self.loadavg[title]}) ...")

    def _write(self, out: Path, docs: str, figures: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "runtimes.json").write_text(json.dumps(figures, indent=2, default=str))
        markdown = render_markdown(figures)
        (out / "runtimes.md").write_text(markdown)
        if docs:
            Path(docs).mkdir(parents=True, exist_ok=True)
            (Path(docs) / "runtimes.md").write_text(markdown)
        self.stdout.write(markdown)


def render_markdown(figures: dict[str, Any]) -> str:
    meta = figures["meta"]
    lines = [
        "# Sandbox runtimes: runc against gVisor (runsc)",
        "",
        f"`python manage.py bench_runtimes` (lab/bench/runtimes.py), run {meta['run']}: {meta['cpus']} cores, "
        f"Docker engine {meta['engine']}, runsc with {meta['runsc_args']}; {meta['rounds']} samples of starts, "
        f"snapshots and forks, {meta['call_rounds']} rounds of calls; runtimes interleaved round by round. "
        f"1-min load average at each section: {meta['loadavg']}. Median / P95 in ms.",
        "",
    ]
    lines += [
        "Container start (create + start + the shell session's first state):",
        "",
        "| image | runc | runsc |",
        "|---|---|---|",
    ]
    for s in figures.get("starts", []):
        lines.append(f"| {s['image']} | {median_p95(s['runc'])} | {median_p95(s['runsc'])} |")
    lines += [
        "",
        "A bash call in a running sandbox: plain (a replay) and observed (a tool-server miss: the files, "
        "the session and the live processes listed before and after the call):",
        "",
        "| image | command | runc | runsc | runc, observed | runsc, observed |",
        "|---|---|---|---|---|---|",
    ]
    for c in figures.get("calls", []):
        for command in bench.CALLS:
            plain, observed = f"{command} (plain)", f"{command} (observed)"
            lines.append(
                f"| {c['image']} | `{command}` | {median_p95(c['runc'].get(plain))} | {median_p95(c['runsc'].get(plain))} "
                f"| {median_p95(c['runc'].get(observed))} | {median_p95(c['runsc'].get(observed))} |"
            )
        lines.append(
            f"| {c['image']} | a sandbox's first call (observed) | | | {median_p95(c['runc'].get('first'))} "
            f"| {median_p95(c['runsc'].get('first'))} |"
        )
    lines += [
        "",
        "Snapshot and fork of a sandbox left running a web server (busybox httpd), a background "
        "process and a process holding the memory said (busybox image). runc: a commit, its forks start "
        "without the processes; runsc: a checkpoint plus a commit, its forks are restored with them:",
        "",
        "| memory held | runtime | snapshot | size on disk MB | fork | fork + first call | source's next call "
        "| fork's memory MB | keeps processes | the fork's probe (page, sleeps) |",
        "|---:|---|---|---:|---|---|---|---:|---|---|",
    ]
    for s in figures.get("snapshots", []):
        for runtime in bench.RUNTIMES:
            r = s[runtime]
            lines.append(
                f"| {s['memory_mb']} MB | {runtime} | {median_p95(r['snapshot'])} | {r['size_mb']} | {median_p95(r['fork'])} "
                f"| {median_p95(r['fork_and_first_call'])} | {median_p95(r['source_next_call'])} | {r['fork_memory_mb']} "
                f"| {r['keeps_processes']} | {r['fork_probe']} |"
            )
    lines += ["", f"Cleanup: {figures.get('cleanup')}", ""]
    return "\n".join(lines)
