"""`python manage.py bench_sandboxes`: managed sandboxes and tool-server mode, measured.

0. a bash call by `docker exec` against the session agent (busybox and debian, `true` and
   `echo hi > f`, plain and observed, interleaved);
1. the docker backend alone: cold fork (snapshot -> running container -> first exec), snapshot
   cost against the size a sandbox wrote, container starts per second at limiter settings;
2. hand-over of a READY pre-fork through the pool services (`sandbox_acquire` + attaching its
   handle), in this process;
3. the service as deployed (uvicorn + a Celery worker on a queue of the run's own), over HTTP:
   a rollout's first miss with and without a ready pre-fork, then tool-server rollouts (tasks x
   rollouts x epochs of bash calls) against the same rollouts run directly in fresh sandboxes.

Figures go to artifacts/bench/sandboxes.json and sandboxes.md. Every task, rollout, sandbox,
snapshot and token the run creates is removed at the end. Quick smoke run:
`python manage.py bench_sandboxes --epochs 1 --rollouts 2 --rounds 3 --sizes 0,1 --starts 4`.
`--only calls` runs section 0 alone and writes artifacts/bench/sandboxes-calls.json and .md.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count

from accounts.models import ApiToken
from accounts.services.tokens import token_create
from cache.models import Lease, Rollout, Snapshot, Task
from cache.services import node_record, snapshot_register, task_put
from cache.tcg import ToolCall
from cache.tcg.records import CallContext, CallRecord
from lab.bench import sandboxes as bench
from lab.figures import median_p95
from lab.server import service_running
from sandboxes import services
from sandboxes.backends.config import DockerConfig
from sandboxes.backends.docker import DockerBackend
from sandboxes.handles import TASK_LABEL, backend_named, forget, labels
from sandboxes.handles import handle as sandbox_handle
from sandboxes.images import BUSYBOX_TAG, DEBIAN_TAG
from sandboxes.models import Sandbox

# Slow enough for the snapshot policy (learned docker commit cost + restore cost) to snapshot after it.
SETUP = "sleep 3; echo ready > /f"


class Command(BaseCommand):
    help = "Benchmark managed sandboxes: forks, snapshots, starts, hand-over and tool-server rollouts."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--epochs", type=int, default=3)
        parser.add_argument("--rollouts", type=int, default=8, help="rollouts per task per epoch")
        parser.add_argument("--tasks", default="busybox,gcc", help=f"policies: {', '.join(bench.POLICIES)}")
        parser.add_argument("--rounds", type=int, default=20, help="samples for fork and hand-over latencies")
        parser.add_argument("--sizes", default="0,10,100", help="MB written before a snapshot")
        parser.add_argument("--starts", type=int, default=16, help="containers started per limiter setting")
        parser.add_argument("--uvicorn-workers", type=int, default=2)
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--call-rounds", type=int, default=200, help="rounds of calls for exec against the session")
        parser.add_argument("--only", choices=["calls"], help="run one section alone")
        parser.add_argument("--out", type=Path, default=Path(settings.BASE_DIR) / "artifacts" / "bench")

    def handle(self, *args: Any, **opts: Any) -> None:
        run_id = datetime.now().strftime("%Y%m%d%H%M%S")
        self.prefix = f"bench-sbx-{run_id}"
        self.bench_labels = {bench.BENCH_LABEL: f"{run_id}-{uuid.uuid4().hex[:8]}"}
        self.task_ids: list[str] = []
        self.token_name = f"{self.prefix}-token"
        self.setting = settings.TVCACHE["DOCKER_MAX_CONCURRENT_STARTS"]
        figures: dict[str, Any] = {
            "meta": {
                "run": run_id,
                "cpus": os.cpu_count(),
                "epochs": opts["epochs"],
                "rollouts": opts["rollouts"],
                "tasks": opts["tasks"].split(","),
                "rounds": opts["rounds"],
                "uvicorn_workers": opts["uvicorn_workers"],
                "max_concurrent_starts_setting": self.setting,
                "seed": opts["seed"],
                "loadavg": {},
            }
        }
        self.loadavg = figures["meta"]["loadavg"]
        backend = DockerBackend(DockerConfig(max_concurrent_starts=self.setting))
        if opts["only"] == "calls":
            try:
                figures["calls"] = self._calls(opts["call_rounds"])
            finally:
                figures["cleanup"] = {"direct_leftover_on_engine": bench.remove_labelled(backend, self.bench_labels)}
            self._write(opts["out"], figures, name="sandboxes-calls")
            return
        try:
            figures["calls"] = self._calls(opts["call_rounds"])
            self._section("cold forks")
            figures["cold_fork"] = [
                bench.cold_forks(backend, image, self.bench_labels, opts["rounds"])
                for image in (BUSYBOX_TAG, DEBIAN_TAG)
            ]
            self._section("snapshot cost against size")
            figures["snapshot_size"] = bench.snapshot_sizes(
                backend, BUSYBOX_TAG, self.bench_labels, [int(s) for s in opts["sizes"].split(",")], 3
            )
            self._section("container starts per second")
            figures["starts"] = bench.start_rates(
                lambda c: DockerBackend(DockerConfig(max_concurrent_starts=c)),
                BUSYBOX_TAG,
                self.bench_labels,
                sorted({1, self.setting, 4}),
                opts["starts"],
            )
            self._section("pre-fork hand-over (services, in process)")
            figures["handover"] = self._handover(opts["rounds"])
            self._section("the service as deployed")
            log_dir = Path(settings.VAR_DIR) / "bench"
            log_dir.mkdir(parents=True, exist_ok=True)
            with service_running(workers=opts["uvicorn_workers"], celery=True, log_dir=log_dir) as deployment:
                token = token_create(name=self.token_name)
                with httpx.Client(
                    base_url=deployment.url, headers={"Authorization": f"Token {token}"}, timeout=600
                ) as client:
                    self._section("first miss in tool-server mode")
                    figures["first_miss"] = self._first_miss(client, max(3, opts["rounds"] // 2))
                    self._section("tool-server rollouts")
                    figures["toolserver"] = self._toolserver(deployment.url, token, opts)
        finally:
            self._section("cleanup")
            figures["cleanup"] = self._clean(backend)
        self._write(opts["out"], figures)

    def _calls(self, rounds: int) -> list[dict[str, Any]]:
        self._section("a call: docker exec against the session agent")
        return [
            bench.call_latency(
                lambda session: DockerBackend(DockerConfig(session=session)), image, self.bench_labels, rounds
            )
            for image in (BUSYBOX_TAG, DEBIAN_TAG)
        ]

    def _section(self, title: str) -> None:
        # Other work on the machine shows here: the figures assume the bench has it to itself.
        self.loadavg[title] = round(os.getloadavg()[0], 2)
        self.stdout.write(f"[{time.strftime('%H:%M:%S')}] {title} (load {self.loadavg[title]}) ...")

    # --- hand-over through the pool services ----------------------------------------------------

    def _bench_task(self, name: str, image: str) -> str:
        task_id = f"{self.prefix}-{name}"
        task_put(task_id=task_id, env={"backend": "docker", "image": image}, tools={}, sandbox_budget=64)
        self.task_ids.append(task_id)
        return task_id

    def _handover(self, rounds: int) -> dict[str, Any]:
        """A rollout takes a READY pre-fork: sandbox_acquire (row lock, state change) plus the handle
        on the running container. The handle is dropped first: in production a worker warmed the
        fork and the web process serving the rollout has never seen it."""
        task_id = self._bench_task("handover", BUSYBOX_TAG)
        backend = backend_named("docker")
        snapshot = self._service_snapshot(task_id, backend)
        rows = [
            Sandbox.objects.create(task_id=task_id, backend="docker", pool=Sandbox.Pool.FORK, snapshot=snapshot)
            for _ in range(rounds)
        ]
        warm = []
        for row in rows:  # what the Celery task does, timed here
            ms, _ = bench.timed_ms(lambda: services.sandbox_warm(sandbox_id=row.pk))
            warm.append(ms)
        acquire, attach, handover, first_exec, handover_cached = [], [], [], [], []
        for index, row in enumerate(rows):
            ref = Sandbox.objects.get(pk=row.pk).ref
            forget("docker", ref)
            rollout = Rollout.objects.create(task_id=task_id, rollout_id=f"h{index}")
            acquire_ms, taken = bench.timed_ms(
                lambda: services.sandbox_acquire(task_id=task_id, snapshot_id=snapshot.pk, rollout_pk=rollout.pk)
            )
            attach_ms, sandbox = bench.timed_ms(lambda: sandbox_handle(backend, taken.ref))
            exec_ms, result = bench.timed_ms(lambda: sandbox.execute("bash", {"command": "cat /f"}))
            assert result["stdout"] == "ready\n", result
            acquire.append(acquire_ms)
            attach.append(attach_ms)
            handover.append(acquire_ms + attach_ms)
            first_exec.append(exec_ms)
            # The same hand-over when the handle is already cached in the process.
            cached_ms, _ = bench.timed_ms(lambda: sandbox_handle(backend, taken.ref))
            handover_cached.append(acquire_ms + cached_ms)
            services.sandbox_stop(sandbox_id=taken.pk)
        return {
            "warm_fork_in_worker": bench.summary(warm),
            "acquire": bench.summary(acquire),
            "attach": bench.summary(attach),
            "handover": bench.summary(handover),
            "handover_handle_cached": bench.summary(handover_cached),
            "first_exec": bench.summary(first_exec),
            "handover_and_first_exec": bench.summary([h + e for h, e in zip(handover, first_exec)]),
        }

    def _service_snapshot(self, task_id: str, backend) -> Snapshot:
        """A service-owned snapshot after SETUP, recorded as the tool server would."""
        with backend.start(Task.objects.get(pk=task_id).env, labels=labels(task_id)) as source:
            exec_ms, result = bench.timed_ms(lambda: source.execute("bash", {"command": SETUP}))
            context = CallContext((), ToolCall("bash", {"command": SETUP}), "setup", 0, None)
            outcome = node_record(task_id=task_id, record=CallRecord(context, result, exec_ms))
            info = source.snapshot(labels=labels(task_id))
        snapshot, _ = snapshot_register(
            task_id=task_id,
            node_id=outcome.node_id,
            ref=info.ref,
            backend="docker",
            size_bytes=info.size_bytes,
            create_ms=info.create_ms,
            owner=Snapshot.Owner.SERVICE,
        )
        return snapshot

    # --- over HTTP ------------------------------------------------------------------------------

    def _first_miss(self, client: httpx.Client, rounds: int) -> dict[str, Any]:
        """A new rollout replays the setup (a hit) and then misses: it resumes from the setup's
        snapshot, in a ready pre-fork when the worker made one, else in a fork on the critical path.
        Its second miss runs in the sandbox it already has (the call's own cost)."""
        task_id = self._http_task(client, "first", BUSYBOX_TAG)
        calls = f"/api/v1/tasks/{task_id}/rollouts"
        self._post(client, f"{calls}/seed/calls", bash_call(SETUP))
        client.delete(f"{calls}/seed")
        snapshot = Snapshot.objects.filter(task_id=task_id, status=Snapshot.Status.LIVE).first()
        if snapshot is None:
            return {"error": "the setup call was not snapshotted (snapshot policy)"}
        forks = Sandbox.objects.filter(snapshot=snapshot)
        figures: dict[str, Any] = {}
        for mode in ("ready_prefork", "no_prefork"):
            first, server, second, used_prefork = [], [], [], 0
            for index in range(rounds):
                if bench.wait_for(lambda: forks.filter(state=Sandbox.State.READY).exists(), 60) is None:
                    raise RuntimeError("the worker never made a pre-fork ready")
                if mode == "no_prefork":
                    for pk in forks.filter(state__in=[Sandbox.State.READY, Sandbox.State.WARMING]).values_list(
                        "pk", flat=True
                    ):
                        services.sandbox_stop(sandbox_id=pk)
                ready_before = set(forks.filter(state=Sandbox.State.READY).values_list("pk", flat=True))
                rollout = f"{mode}-{index}"
                hit = self._post(client, f"{calls}/{rollout}/calls", bash_call(SETUP))
                assert hit["cached"], hit
                ms, answer = bench.timed_ms(
                    lambda: self._post(client, f"{calls}/{rollout}/calls", bash_call(f"cat /f; echo {mode} {index}"))
                )
                assert not answer["cached"] and answer["result"]["stdout"].startswith("ready\n"), answer
                first.append(ms)
                server.append(answer["latency_ms"])
                used = Sandbox.objects.filter(rollout__task_id=task_id, rollout__rollout_id=rollout).values_list(
                    "pk", flat=True
                )
                used_prefork += bool(set(used) & ready_before)
                second.append(
                    bench.timed_ms(
                        lambda: self._post(client, f"{calls}/{rollout}/calls", bash_call(f"echo again {mode} {index}"))
                    )[0]
                )
                client.delete(f"{calls}/{rollout}")
            figures[mode] = {
                "first_miss": bench.summary(first),
                "first_miss_server": bench.summary(server),
                "second_miss": bench.summary(second),
                "took_ready_prefork": used_prefork,
                "rounds": rounds,
            }
        return figures

    def _http_task(self, client: httpx.Client, name: str, image: str) -> str:
        task_id = f"{self.prefix}-{name}"
        response = client.put(
            f"/api/v1/tasks/{task_id}",
            json={"env": {"backend": "docker", "image": image}, "tools": {}, "sandbox_budget": 64},
        )
        response.raise_for_status()
        self.task_ids.append(task_id)
        return task_id

    @staticmethod
    def _post(client: httpx.Client, path: str, body: dict) -> dict:
        response = client.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
        return response.json()

    def _toolserver(self, url: str, token: str, opts: dict[str, Any]) -> dict[str, Any]:
        policies = opts["tasks"].split(",")
        headers = {"Authorization": f"Token {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
            task_ids = {name: self._http_task(client, f"ts-{name}", bench.POLICIES[name].image) for name in policies}
        direct = DockerBackend(DockerConfig(max_concurrent_starts=self.setting))
        epochs, windows = [], []
        clients = [
            httpx.Client(base_url=url, headers=headers, timeout=600) for _ in range(len(policies) * opts["rollouts"])
        ]
        try:
            for epoch in range(opts["epochs"]):
                plans = bench.epoch_plans(task_ids, opts["rollouts"], epoch, opts["seed"])
                announced = datetime.now().astimezone()
                warmup_s = self._announce(clients[0], list(task_ids.values()), opts["rollouts"], epoch)
                client_of = {plan.rollout_id + plan.task_id: clients[i] for i, plan in enumerate(plans)}
                step_ms, cached_runs = bench.run_parallel(
                    lambda plan: bench.run_with_cache(client_of[plan.rollout_id + plan.task_id], plan, epoch), plans
                )
                windows.append(announced)
                self.stdout.write(f"  epoch {epoch}: with cache done in {step_ms / 1000:.1f} s")
                _, direct_runs = bench.run_parallel(
                    lambda plan: bench.run_without_cache(direct, plan, self.bench_labels), plans
                )
                epochs.append(
                    {
                        "epoch": epoch,
                        "warmup_s": warmup_s,
                        "with_cache": bench.epoch_figures(cached_runs),
                        "without_cache": {**bench.epoch_figures(direct_runs), "containers": len(direct_runs)},
                        "per_task_hit_rate": {
                            name: bench.epoch_figures([r for r in cached_runs if r.plan.policy == name])["hit_rate"]
                            for name in policies
                        },
                    }
                )
        finally:
            for client in clients:
                client.close()
        # Containers the service started in each epoch's window (announcement to next announcement):
        # warmed roots, pre-forks and critical-path starts and forks.
        bench.wait_for(lambda: not Sandbox.objects.filter(task_id__in=task_ids.values(), state="warming").exists(), 60)
        bounds = [*windows[1:], None]
        for figures, start, end in zip(epochs, windows, bounds):
            rows = Sandbox.objects.filter(task_id__in=task_ids.values(), created_at__gte=start).exclude(ref="")
            if end is not None:
                rows = rows.filter(created_at__lt=end)
            by_pool = dict(rows.values("pool").annotate(n=Count("id")).values_list("pool", "n"))
            figures["with_cache"]["containers"] = sum(by_pool.values())
            figures["with_cache"]["containers_by_pool"] = by_pool
        snapshots = Snapshot.objects.filter(task_id__in=task_ids.values())
        # Every rollout has ended (DELETE): no lease on the tasks' snapshots should remain open.
        open_leases = Lease.objects.filter(snapshot__task_id__in=task_ids.values(), released_at__isnull=True).count()
        return {
            "task_ids": task_ids,
            "epochs": epochs,
            "snapshots_taken": snapshots.count(),
            "open_leases_after_rollouts_ended": open_leases,
            "leases_granted": Lease.objects.filter(snapshot__task_id__in=task_ids.values()).count(),
            "snapshot_commit": bench.summary([s.create_ms for s in snapshots if s.create_ms is not None]),
        }

    def _announce(self, client: httpx.Client, task_ids: list[str], rollouts: int, epoch: int) -> float | None:
        """POST /steps, then give the workers until the pools are warm (the trainer generates the
        first tokens meanwhile). Returns how long that took."""
        response = client.post("/api/v1/steps", json={"tasks": task_ids, "rollouts_per_task": rollouts, "epoch": epoch})
        response.raise_for_status()
        waited = bench.wait_for(lambda: not Sandbox.objects.filter(task_id__in=task_ids, state="warming").exists(), 120)
        return round(waited, 2) if waited is not None else None

    # --- cleanup and output ---------------------------------------------------------------------

    def _clean(self, backend: DockerBackend) -> dict[str, Any]:
        """Stop the bench tasks' sandboxes, evict and delete their snapshots, delete the tasks and
        the token; then count what was still on the engine (should be nothing)."""
        done: dict[str, Any] = {"tasks": len(self.task_ids)}
        live = Sandbox.objects.filter(task_id__in=self.task_ids).exclude(state=Sandbox.State.STOPPED)
        done["sandboxes_stopped"] = sum(
            services.sandbox_stop(sandbox_id=pk) for pk in list(live.values_list("pk", flat=True))
        )
        done["open_leases"] = Lease.objects.filter(
            snapshot__task_id__in=self.task_ids, released_at__isnull=True
        ).count()
        Task.objects.filter(pk__in=self.task_ids).update(sandbox_budget=0)
        services.snapshots_collect()
        # A snapshot held by an open lease is spared by eviction; its image is removed below.
        done["snapshots_spared_by_collect"] = Snapshot.objects.filter(
            task_id__in=self.task_ids, status=Snapshot.Status.LIVE
        ).count()
        docker = backend_named("docker")
        leftovers = {"sandboxes": 0, "snapshots": 0}
        for task_id in self.task_ids:
            removed = bench.remove_labelled(docker, {TASK_LABEL: task_id})
            leftovers = {k: leftovers[k] + removed[k] for k in leftovers}
        done["leftover_on_engine"] = leftovers
        done["direct_leftover_on_engine"] = bench.remove_labelled(backend, self.bench_labels)
        Task.objects.filter(pk__in=self.task_ids).delete()
        ApiToken.objects.filter(name=self.token_name).delete()
        return done

    def _write(self, out: Path, figures: dict[str, Any], name: str = "sandboxes") -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(figures, indent=2, default=str))
        markdown = render_markdown(figures)
        (out / f"{name}.md").write_text(markdown)
        self.stdout.write(markdown)


def bash_call(command: str) -> dict[str, Any]:
    return {"call": bench.bash(command)}


def render_markdown(figures: dict[str, Any]) -> str:
    """The tables (median / P95 in ms unless said otherwise)."""
    meta = figures["meta"]
    lines = [
        f"Run {meta['run']} ({meta['cpus']} cores; limiter setting {meta['max_concurrent_starts_setting']}; "
        f"{meta['uvicorn_workers']} uvicorn workers; seed {meta['seed']}; 1-min load average at each section: "
        f"{meta['loadavg']}).",
        "",
    ]
    if "calls" in figures:
        lines += [
            "A bash call in a running sandbox: a `docker exec` per call against the session agent (one per "
            "container), interleaved call by call, median / P95 ms (observed: execute_observed, the layer "
            "listed on the host before and after, as a tool-server miss runs):",
            "",
            "| image | command | exec | session | exec, observed | session, observed |",
            "|---|---|---|---|---|---|",
        ]
        for c in figures["calls"]:
            e, s = c["exec"], c["session"]
            for command in bench.CALL_COMMANDS:
                plain, observed = f"{command} (plain)", f"{command} (observed)"
                lines.append(
                    f"| {c['image']} | `{command}` | {median_p95(e[plain])} | {median_p95(s[plain])} | {median_p95(e[observed])} "
                    f"| {median_p95(s[observed])} |"
                )
            lines.append(
                f"| {c['image']} | first call of a sandbox | {median_p95(e['first'])} | {median_p95(s['first'])} | | |"
            )
        lines.append("")
    if "handover" in figures:
        h = figures["handover"]
        lines += [
            "Hand-over of a READY pre-fork (services in process), median / P95 ms:",
            "",
            "| acquire | attach handle | hand-over (acquire + attach) | hand-over, handle cached | first exec | hand-over + first exec | warming the fork (worker) |",
            "|---|---|---|---|---|---|---|",
            f"| {median_p95(h['acquire'])} | {median_p95(h['attach'])} | {median_p95(h['handover'])} | {median_p95(h['handover_handle_cached'])} "
            f"| {median_p95(h['first_exec'])} | {median_p95(h['handover_and_first_exec'])} | {median_p95(h['warm_fork_in_worker'])} |",
            "",
        ]
    if "first_miss" in figures and "ready_prefork" in figures["first_miss"]:
        lines += [
            "A rollout's first miss after a hit on the snapshotted setup, over HTTP (tool-server mode), median / P95 ms:",
            "",
            "| | first miss (client) | first miss (server) | second miss (same sandbox) | took a ready pre-fork |",
            "|---|---|---|---|---:|",
        ]
        for mode, title in (
            ("ready_prefork", "ready pre-fork"),
            ("no_prefork", "no pre-fork: fork on the critical path"),
        ):
            f = figures["first_miss"][mode]
            lines.append(
                f"| {title} | {median_p95(f['first_miss'])} | {median_p95(f['first_miss_server'])} | {median_p95(f['second_miss'])} "
                f"| {f['took_ready_prefork']} / {f['rounds']} |"
            )
        lines.append("")
    if "cold_fork" in figures:
        lines += [
            "Cold fork (docker backend): snapshot -> running container -> first exec, median / P95 ms:",
            "",
            "| image | commit | fork (create + start) | first exec | fork + first exec | again, 2nd fork of the snapshot |",
            "|---|---|---|---|---|---|",
        ]
        for c in figures["cold_fork"]:
            lines.append(
                f"| {c['image']} | {median_p95(c['snapshot_commit'])} | {median_p95(c['fork'])} | {median_p95(c['first_exec'])} "
                f"| {median_p95(c['fork_and_first_exec'])} | {median_p95(c['second_fork_and_first_exec'])} |"
            )
        lines.append("")
    if "snapshot_size" in figures:
        lines += [
            "Snapshot cost against what the sandbox wrote (busybox, 3 samples each), median / P95 ms:",
            "",
            "| written MB | commit ms | snapshot size MB | fork + first exec ms |",
            "|---:|---|---:|---|",
        ]
        for s in figures["snapshot_size"]:
            lines.append(
                f"| {s['written_mb']} | {median_p95(s['commit'])} | {s['size_mb']} | {median_p95(s['fork_and_first_exec'])} |"
            )
        lines.append("")
    if "starts" in figures:
        lines += [
            "Container starts (create + start + shell session), 8 callers at once:",
            "",
            "| max concurrent starts | starts | starts/s | one start, median / P95 ms |",
            "|---:|---:|---:|---|",
        ]
        for s in figures["starts"]:
            lines.append(
                f"| {s['max_concurrent_starts']} | {s['starts']} | {s['starts_per_s']} | {median_p95(s['start'])} |"
            )
        lines.append("")
    if "toolserver" in figures:
        t = figures["toolserver"]
        lines += [
            f"Tool-server mode over HTTP ({', '.join(t['task_ids'])} x {figures['meta']['rollouts']} rollouts in "
            "parallel per epoch) against the same rollouts run directly in fresh sandboxes:",
            "",
            "| epoch | calls | hit rate | call latency with cache | without cache | hits / misses with cache "
            "| step s with / without | containers with / without | errors |",
            "|---:|---:|---:|---|---|---|---|---|---:|",
        ]
        for e in t["epochs"]:
            w, d = e["with_cache"], e["without_cache"]
            lines.append(
                f"| {e['epoch']} | {w['calls']} | {w['hit_rate']:.0%} | {median_p95(w['call'])} | {median_p95(d['call'])} "
                f"| {median_p95(w['hit'])} / {median_p95(w['miss'])} | {w['step_s']} / {d['step_s']} "
                f"| {w.get('containers', '-')} / {d['containers']} | {w['error_count']} |"
            )
        lines += [
            "",
            f"Snapshots taken: {t['snapshots_taken']} (commit {median_p95(t['snapshot_commit'])} ms); "
            f"leases granted {t['leases_granted']}, still open after every rollout ended "
            f"{t['open_leases_after_rollouts_ended']}; "
            f"hit rate per task and epoch: {[e['per_task_hit_rate'] for e in t['epochs']]}; "
            f"containers by pool: {[e['with_cache'].get('containers_by_pool') for e in t['epochs']]}; "
            f"warm-up after the announcement (s): {[e['warmup_s'] for e in t['epochs']]}",
            "",
        ]
    lines += [f"Cleanup: {figures.get('cleanup')}", ""]
    return "\n".join(lines)
