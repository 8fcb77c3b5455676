"""The docker backend: one container per sandbox on one Docker engine, driven through the Docker
Engine API (docker SDK): starts and forks under the engine's start limiter (a fork of a checkpoint
snapshot restored from its checkpoint: checkpoint.py), attach, snapshot deletion, listing what is
ours, the env fingerprint's facts, health."""

from __future__ import annotations

import dataclasses
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import docker
import docker.errors

from ..base import (
    OWNER,
    OWNER_LABEL,
    EngineUnavailable,
    InvalidEnv,
    OwnedResource,
    SandboxBackend,
    SandboxError,
    SandboxGone,
    SnapshotMissing,
    ToolSpec,
    check_labels,
)
from ..config import DockerConfig
from .checkpoint import CheckpointStore, SandboxRuntime, checkpoint_delete, checkpoint_start
from .confinement import HOME, KEEPALIVE, DockerEnv
from .engine import EngineConnection, EngineFacts, EngineFactsCache, StartLimiter, engine_errors
from .images import (
    SHELL_LABEL,
    SNAPSHOT_REF,
    BaseLayers,
    checkpoint_of,
    container_labels,
    drop_if_deleted_snapshot,
    is_snapshot,
    label_filter,
    owned,
)
from .quota import DiskWatch
from .sandbox import DockerSandbox
from .session import session_init, shell_probe

# Bump when the bash tool's behaviour changes: it is part of the env fingerprint (4: the shell
# session is kept by the host, no longer in the container's /.tvcache).
TOOLS_VERSION = 4


class DockerBackend(SandboxBackend):
    name = "docker"
    tools = {"bash": ToolSpec(mutates_state=True)}

    def audit_view(self, tool: str, result: Mapping[str, Any]) -> Any:
        """What the agent reads of a bash call; a call that timed out was cut short at a moment
        that proves nothing about the tool."""
        if result.get("timed_out"):
            return None
        return {key: result.get(key) for key in ("stdout", "stderr", "exit_code")}

    def __init__(self, config: DockerConfig = DockerConfig()):
        self.config = config
        self.engine = EngineConnection(config)
        self.limiter = StartLimiter(config.max_concurrent_starts)
        self.disk_watch = DiskWatch(config.disk_check_s)
        # Whether the engine enforces an overlay size limit (--storage-opt size): None until tried.
        self.storage_quota: bool | None = None
        self._base_layers = BaseLayers()
        # The engine whose images this one runs (DockerConfig.images_from), and the ids it gave.
        self.images_from = (
            EngineConnection(dataclasses.replace(config, base_url=config.images_from)) if config.images_from else None
        )
        self._image_ids: dict[str, str] = {}
        self._image_move = threading.Lock()
        self._facts = EngineFactsCache()

    @property
    def api(self) -> docker.APIClient:
        return self.engine.api

    def start(self, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DockerSandbox:
        spec = DockerEnv.parse(env, self.config)
        runtime = self.runtime_for(env, spec)
        with engine_errors():
            image = self._base_image(spec.image)
            with self.limiter.slot():
                container_id = self._create(spec, image, labels, runtime)
                try:
                    probed = session_init(self.api, container_id)
                except BaseException:
                    self._discard(container_id)
                    raise
        shell = (image["Config"].get("Labels") or {}).get(SHELL_LABEL) or probed
        return DockerSandbox(self, container_id, shell=shell, image_size=image["Size"], runtime=runtime)

    def fork(self, ref: str, env: Mapping[str, Any], *, labels: Mapping[str, str]) -> DockerSandbox:
        """A fork of a checkpoint snapshot is restored from its checkpoint (checkpoint.py): its
        processes go on where they were."""
        spec = DockerEnv.parse(env, self.config)
        runtime = self.runtime_for(env, spec)
        if not SNAPSHOT_REF.fullmatch(ref):
            raise SnapshotMissing(f"not a docker snapshot ref: {ref!r}")
        with engine_errors():
            image = self._image(ref, missing=SnapshotMissing(f"snapshot {ref} does not exist"))
            checkpoint = checkpoint_of(image)
            if checkpoint is not None and (checkpoint[1] != runtime.name or not runtime.checkpoints):
                raise SnapshotMissing(
                    f"snapshot {ref} is a checkpoint of runtime {checkpoint[1]!r}, which cannot "
                    f"restore it under {runtime.name!r} here"
                )
            with self.limiter.slot():
                container_id = self._create(spec, image, labels, runtime, checkpoint=checkpoint and checkpoint[0])
        # The fork's own snapshots are measured against the snapshot image it runs from.
        return DockerSandbox(
            self, container_id, shell=image["Config"]["Labels"][SHELL_LABEL], image_size=image["Size"], runtime=runtime
        )

    def runtime_for(self, env: Mapping[str, Any], spec: DockerEnv) -> SandboxRuntime:
        """The runtime the env's sandboxes run under on this engine (checkpoint.py); refused with a
        4xx code where the engine or the operator cannot give it."""
        named = env.get("runtime")
        facts = self.facts(wanted_runtime=named if isinstance(named, str) else self.config.runtime)
        runtime = SandboxRuntime.parse(env, self.config, facts)
        runtime.check_engine(facts, network=spec.network)
        return runtime

    def facts(self, *, wanted_runtime: str | None = None) -> EngineFacts:
        return self._facts.get(self.api, wanted_runtime=wanted_runtime)

    def checkpoint_store(self) -> CheckpointStore:
        return CheckpointStore.for_config(self.facts(), self.config)

    def attach(self, sandbox_id: str) -> DockerSandbox:
        with engine_errors():
            try:
                container = self.api.inspect_container(sandbox_id)
            except docker.errors.NotFound:
                raise SandboxGone(f"container {sandbox_id} does not exist") from None
            if not container["State"]["Running"] or (container["Config"].get("Labels") or {}).get(OWNER_LABEL) != OWNER:
                raise SandboxGone(f"container {sandbox_id} is not a running tvcache sandbox")
            image = self.api.inspect_image(container["Image"])
            shell = (image["Config"].get("Labels") or {}).get(SHELL_LABEL) or shell_probe(self.api, sandbox_id)
            name = (container.get("HostConfig") or {}).get("Runtime") or "runc"
            runtime = SandboxRuntime(name, name in self.config.checkpoint_runtimes and self.facts().checkpoints)
        return DockerSandbox(self, container["Id"], shell=shell, image_size=image["Size"], runtime=runtime)

    def base_layers(self, container_id: str) -> frozenset[str]:
        """The layer folders of the base image a sandbox runs on (below its snapshots' layers)."""
        with engine_errors():
            image_id = self.api.inspect_container(container_id)["Image"]
        return self._base_layers.of(self.api, image_id)

    def delete_snapshot(self, ref: str) -> None:
        if not SNAPSHOT_REF.fullmatch(ref):
            return
        with engine_errors():
            try:
                # force: untag even while forks run from it; the image goes with the last fork.
                self.api.remove_image(ref, force=True)
            except docker.errors.NotFound:
                pass
            self.checkpoint_store().drop(ref.split(":", 1)[1])  # forks run without it

    def fingerprint_material(self, env: Mapping[str, Any]) -> dict[str, Any]:
        spec = DockerEnv.parse(env, self.config)
        with engine_errors():
            image = self._base_image(spec.image)
        return {
            "backend": self.name,
            "tools_version": TOOLS_VERSION,
            "image_id": image["Id"],
            "limits": spec.limits(),
            "confinement": spec.confinement(),
            **self.runtime_for(env, spec).fingerprint(),
        }

    def health(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "max_concurrent_starts": self.limiter.capacity,
            "starts_in_flight": self.limiter.in_flight,
            # True: the engine enforces it (overlay size); False: the layer is watched
            "disk_quota_mb": self.config.disk_mb,
            "storage_quota": self.storage_quota,
        }
        try:
            with engine_errors():
                version = self.api.version()
                running = self.api.containers(filters={"label": label_filter("sandbox", None)}, quiet=True)
            engine = self.facts()
        except (SandboxError, docker.errors.DockerException) as exc:
            return {"ok": False, "error": str(exc), **facts}
        return {
            "ok": True,
            "engine_version": version.get("Version"),
            "api_version": version.get("ApiVersion"),
            "running_sandboxes": len(running),
            "runtimes": sorted(engine.runtimes),
            "checkpoints": engine.checkpoints,  # the engine serves the checkpoint API (runtimes.md)
            **facts,
        }

    def list_sandboxes(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        with engine_errors():
            found = self.api.containers(all=True, filters={"label": label_filter("sandbox", label_selector)})
        return [owned(c["Id"], c.get("Labels"), c.get("Created")) for c in found]

    def list_snapshots(self, label_selector: Mapping[str, str] | None = None) -> list[OwnedResource]:
        with engine_errors():
            found = self.api.images(filters={"label": label_filter("snapshot", label_selector)})
        # Untagged snapshot images were deleted and only wait for their last fork to go.
        return [
            owned(tag, image.get("Labels"), image.get("Created"))
            for image in found
            for tag in image.get("RepoTags") or ()
            if SNAPSHOT_REF.fullmatch(tag)
        ]

    def remove_sandbox(self, sandbox_id: str) -> None:
        with engine_errors():
            self._discard(sandbox_id)

    def _image(self, ref: str, *, missing: SandboxError) -> dict[str, Any]:
        try:
            return self.api.inspect_image(ref)
        except docker.errors.ImageNotFound:
            raise missing from None

    def _base_image(self, name: str) -> dict[str, Any]:
        """The image fresh sandboxes of `name` run: this engine's, or with `images_from` the image of
        that name there, by id, moved here if this engine lacks it."""
        missing = InvalidEnv(f"image {name!r} not found (build it: manage.py build_images)")
        if self.images_from is None:
            return self._image(name, missing=missing)
        try:
            with engine_errors():
                image_id = self.images_from.api.inspect_image(name)["Id"]
        except docker.errors.ImageNotFound:
            raise missing from None
        except EngineUnavailable:
            if name not in self._image_ids:
                raise
            image_id = self._image_ids[name]  # the image engine is down: the id it gave last
        self._image_ids[name] = image_id
        try:
            return self.api.inspect_image(image_id)
        except docker.errors.ImageNotFound:
            return self._image_moved(image_id)

    def _image_moved(self, image_id: str) -> dict[str, Any]:
        """docker save there, docker load here, through a temporary file; the id stays the same.
        Once per image and engine: later starts find it."""
        with self._image_move:
            try:
                return self.api.inspect_image(image_id)  # moved meanwhile by another thread
            except docker.errors.ImageNotFound:
                pass
            with tempfile.TemporaryFile() as archive:
                for chunk in self.images_from.api.get_image(image_id):
                    archive.write(chunk)
                archive.seek(0)
                for message in self.api.load_image(archive):
                    if "error" in message:
                        raise SandboxError(f"image {image_id[:19]} could not be loaded: {message['error']}")
            return self.api.inspect_image(image_id)

    def _create(
        self,
        spec: DockerEnv,
        image: dict[str, Any],
        labels: Mapping[str, str],
        runtime: SandboxRuntime,
        checkpoint: str | None = None,
    ) -> str:
        fresh = not is_snapshot(image)  # a fork's image has it all
        container_id = self._create_container(spec, image, labels, runtime)
        try:
            if spec.non_root and fresh:
                self.api.put_archive(container_id, "/", spec.user_folders())
            if checkpoint:
                self._restore(container_id, checkpoint)
            else:
                self.api.start(container_id)
        except BaseException:
            self._discard(container_id)
            raise
        return container_id

    def _restore(self, container_id: str, checkpoint: str) -> None:
        """Starts a created container from a stored checkpoint; SnapshotMissing when the checkpoint
        is gone, out of this host's reach, or the runtime could not restore it."""
        store = self.checkpoint_store()
        if not store.reachable(container_id):
            raise SnapshotMissing(f"checkpoint {checkpoint} is out of this host's reach (a remote engine)")
        try:
            store.place(checkpoint, container_id)
            checkpoint_start(self.api, container_id, checkpoint)
        except FileNotFoundError as exc:
            raise SnapshotMissing(f"checkpoint {checkpoint} is gone: {exc}") from None
        except (OSError, docker.errors.APIError) as exc:
            raise SnapshotMissing(f"checkpoint {checkpoint} could not be restored: {exc}") from None
        checkpoint_delete(self.api, container_id, checkpoint)  # read by the runtime: the copy is done with

    def _create_container(
        self, spec: DockerEnv, image: dict[str, Any], labels: Mapping[str, str], runtime: SandboxRuntime
    ) -> str:
        """Created with an overlay size limit where the engine can enforce one (overlay2 on xfs
        with pquota); an engine that refuses it is asked once per backend, then no longer."""
        if spec.disk_mb and self.storage_quota is not False:
            try:
                container_id = self._create_with(spec, image, labels, runtime, storage_opt={"size": f"{spec.disk_mb}M"})
            except docker.errors.APIError as exc:
                if "storage-opt" not in str(exc.explanation or exc):
                    raise
                self.storage_quota = False
            else:
                self.storage_quota = True
                return container_id
        return self._create_with(spec, image, labels, runtime, storage_opt=None)

    def _create_with(
        self,
        spec: DockerEnv,
        image: dict[str, Any],
        labels: Mapping[str, str],
        runtime: SandboxRuntime,
        storage_opt: dict[str, str] | None,
    ) -> str:
        return self.api.create_container(
            # By id: the image the caller inspected (and fingerprinted), even if the tag moved since.
            image=image["Id"],
            command=KEEPALIVE,
            hostname="sandbox",
            user=spec.user or None,
            working_dir=spec.workdir or (HOME if spec.non_root else None),
            environment={"HOME": HOME} if spec.non_root else None,
            labels=container_labels(image, check_labels(labels)),
            host_config={
                **spec.host_config(self.api, storage_opt),
                "Runtime": runtime.name,
                "PidsLimit": runtime.engine_pids(spec.pids),
            },
        )["Id"]

    def _discard(self, container_id: str) -> None:
        try:
            container = self.api.inspect_container(container_id)
        except docker.errors.NotFound:
            return
        if container["Config"].get("Labels", {}).get(OWNER_LABEL) != OWNER:
            raise SandboxError(f"container {container_id[:12]} is not a tvcache sandbox")
        try:
            self.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            # Two stoppers at once (a rollout's end and the reaper): the other one removes it.
            if exc.status_code == 409 and "already in progress" in str(exc.explanation):
                return
            raise
        drop_if_deleted_snapshot(self.api, container["Image"])
