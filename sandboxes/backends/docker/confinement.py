"""What a container may do. Confinement comes from the service, not from the task's spec: only
the images the operator allows (never a snapshot image), no network without the operator's grant,
memory/CPU/pid limits up to the operator's maxima (a spec above one is refused), ulimits, an
optional non-root user, a small capability set, no-new-privileges, a fixed hostname (outputs must
not depend on which container ran them), nothing of the host mounted, and a keep-alive `sleep`
under docker's init so orphans are reaped."""

from __future__ import annotations

import io
import re
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import docker

from ..base import (
    ImageNotAllowed,
    InvalidEnv,
    LimitExceeded,
    NetworkNotGranted,
    UserNotAllowed,
    check_env_keys,
)
from ..config import DockerConfig
from .images import SNAPSHOT_REF, image_name

# "runtime" and "keep_processes" are read by checkpoint.py.
_ENV_KEYS = frozenset({"backend", "image", "network", "limits", "workdir", "user", "runtime", "keep_processes"})
_LIMIT_KEYS = frozenset({"memory_mb", "cpus", "pids"})
_USER = re.compile(r"(\d{1,9})(?::(\d{1,9}))?")
# A non-root user's home and default working directory, made by the service in a fresh container.
HOME = "/home/sandbox"
KEEPALIVE = ["sleep", "2147483647"]
# Docker's default set minus raw sockets, mknod, chroot, audit and file capabilities.
_CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP", "NET_BIND_SERVICE"]


@dataclass(frozen=True)
class DockerEnv:
    """A task's docker env spec, validated against the operator's grants, with the service
    defaults filled in. Refusals: InvalidEnv (malformed), NotGranted subclasses (above a grant)."""

    image: str
    network: bool
    memory_mb: int
    cpus: float
    pids: int
    workdir: str | None
    user: str  # "uid:gid", or "" for the image's own user
    ulimits: tuple[tuple[str, int], ...]
    disk_mb: int

    @classmethod
    def parse(cls, env: Mapping[str, Any], config: DockerConfig) -> DockerEnv:
        check_env_keys(env, _ENV_KEYS)
        limits = env.get("limits") or {}
        if not isinstance(limits, Mapping) or set(limits) - _LIMIT_KEYS:
            raise InvalidEnv(f'"limits" may only set {sorted(_LIMIT_KEYS)}')
        parsed = cls(
            image=env.get("image") or config.default_image,
            network=env.get("network", False),
            # The defaults, within the maxima: an operator who lowers a maximum lowers the default.
            memory_mb=limits.get("memory_mb", min(config.memory_mb, config.max_memory_mb)),
            cpus=limits.get("cpus", min(config.cpus, config.max_cpus)),
            pids=limits.get("pids", min(config.pids, config.max_pids)),
            workdir=env.get("workdir"),
            user=_user(env.get("user", config.user), config),
            ulimits=_ulimits(config),
            disk_mb=config.disk_mb,
        )
        parsed._check(config)
        return parsed

    def _check(self, config: DockerConfig) -> None:
        if not isinstance(self.image, str) or not isinstance(self.network, bool):
            raise InvalidEnv('"image" must be a string and "network" a boolean')
        if self.workdir is not None and not (
            isinstance(self.workdir, str)
            and self.workdir.startswith("/")
            and "\x00" not in self.workdir
            and len(self.workdir) <= 4096
        ):
            raise InvalidEnv('"workdir" must be an absolute path')
        for name in ("memory_mb", "cpus", "pids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidEnv(f"limits.{name} must be a positive number")
            if name != "cpus" and not isinstance(value, int):
                raise InvalidEnv(f"limits.{name} must be an integer")
            most = getattr(config, f"max_{name}")
            if not value <= most:
                raise LimitExceeded(
                    f"limits.{name} may be at most {most} on this service",
                    details={"limit": name, "requested": value, "max": most},
                )
        if self.network and not config.allow_network:
            raise NetworkNotGranted("network access is not granted on this service (TVCACHE_DOCKER_ALLOW_NETWORK)")
        allowed = allowed_images(config)
        if SNAPSHOT_REF.fullmatch(image_name(self.image)) or image_name(self.image) not in allowed:
            raise ImageNotAllowed(
                f"image {self.image!r} is not one this service runs (TVCACHE_DOCKER_IMAGES)",
                details={"allowed": sorted(allowed)},
            )

    def limits(self) -> dict[str, Any]:
        return {"memory_mb": self.memory_mb, "cpus": self.cpus, "pids": self.pids}

    def confinement(self) -> dict[str, Any]:
        """What the service imposes beyond the task's limits; tool results can depend on it (`id`,
        `ulimit -a`, a write past the quota), so it is part of the env fingerprint."""
        return {"user": self.user, "ulimits": dict(self.ulimits), "disk_mb": self.disk_mb}

    @property
    def non_root(self) -> bool:
        return bool(self.user) and not self.user.startswith("0:")

    def host_config(self, api: docker.APIClient, storage_opt: dict[str, str] | None) -> dict[str, Any]:
        return api.create_host_config(
            network_mode="bridge" if self.network else "none",
            mem_limit=f"{self.memory_mb}m",
            memswap_limit=f"{self.memory_mb}m",  # no swap on top
            nano_cpus=int(self.cpus * 1e9),
            pids_limit=self.pids,
            ulimits=[docker.types.Ulimit(name=name, soft=value, hard=value) for name, value in self.ulimits],
            storage_opt=storage_opt,
            cap_drop=["ALL"],
            cap_add=_CAPABILITIES,
            security_opt=["no-new-privileges"],
            privileged=False,
            init=True,
        )

    def user_folders(self) -> bytes:
        """A tar of the folder a non-root user needs in a fresh container: its home. Fixed times:
        every sandbox of a task starts alike."""
        uid, gid = (int(part) for part in self.user.split(":"))
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for name, mode in ((HOME.lstrip("/"), 0o755),):
                info = tarfile.TarInfo(name)
                info.type, info.mode, info.uid, info.gid, info.mtime = tarfile.DIRTYPE, mode, uid, gid, 0
                tar.addfile(info)
        return buffer.getvalue()


def allowed_images(config: DockerConfig) -> frozenset[str]:
    """The operator's images, by normalized name; snapshot images never, whatever the list says."""
    names = {image_name(image) for image in (*config.images, config.default_image)}
    return frozenset(name for name in names if not SNAPSHOT_REF.fullmatch(name))


def _user(value: Any, config: DockerConfig) -> str:
    """ "uid[:gid]" (numeric: names would need the image's passwd) as "uid:gid"; "" is the image's
    user. A non-root operator default is a floor: a task may name another non-root user only."""
    if not isinstance(value, str) or (value and not _USER.fullmatch(value)):
        raise InvalidEnv('"user" must be a numeric "uid" or "uid:gid"')
    if value:
        uid, gid = _USER.fullmatch(value).groups()
        value = f"{int(uid)}:{int(gid if gid is not None else uid)}"
    floor = _USER.fullmatch(config.user)
    if floor and int(floor.group(1)) != 0 and (not value or value.startswith("0:")):
        raise UserNotAllowed(
            "this service runs sandboxes as a non-root user (TVCACHE_DOCKER_USER)", details={"user": config.user}
        )
    return value


def _ulimits(config: DockerConfig) -> tuple[tuple[str, int], ...]:
    fsize_mb = config.ulimit_fsize_mb or config.disk_mb
    limits = (("nofile", config.ulimit_nofile), ("nproc", config.ulimit_nproc), ("fsize", fsize_mb * 2**20))
    return tuple((name, value) for name, value in limits if value > 0)
