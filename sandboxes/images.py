"""Base images for the docker backend, built locally from Debian packages (no registry is assumed).

- tvcache/busybox:latest: the busybox-static binary and its applet links; builds in seconds,
  used by tests and by tasks that only need a POSIX shell.
- tvcache/debian:bookworm: debootstrap minbase plus bash, python3, git, make and gcc; about a
  minute. The rootfs tarball is cached under the var dir, so rebuilding is an import.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

from sandboxes.backends.base import OWNER, OWNER_LABEL
from sandboxes.backends.config import BUSYBOX_TAG, DEBIAN_TAG
from sandboxes.backends.docker import SHELL_LABEL

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# libc6-dev: gcc can compile but not link without it (debootstrap skips Recommends).
DEBIAN_PACKAGES = ("bash", "ca-certificates", "python3", "git", "make", "gcc", "libc6-dev")
_BUSYBOX_DIRS = {
    **dict.fromkeys(["bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "var", "home", "dev"], 0o755),
    **dict.fromkeys(["tmp", "var/tmp"], 0o1777),
    **dict.fromkeys(["proc", "sys"], 0o555),
    "root": 0o700,
}
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class BuiltImage:
    tag: str
    image_id: str
    seconds: float
    built: bool  # False: the image existed and was kept


def build_busybox_image(
    client: docker.DockerClient | None = None, *, force: bool = False, busybox: Path = Path("/bin/busybox")
) -> BuiltImage:
    client = client or docker.from_env()
    started = time.perf_counter()
    existing = _existing(client, BUSYBOX_TAG)
    if existing and not force:
        return BuiltImage(BUSYBOX_TAG, existing, 0.0, built=False)
    rootfs = _busybox_rootfs_tar(busybox)
    repository, tag = BUSYBOX_TAG.split(":")
    client.api.import_image_from_data(rootfs, repository=repository, tag=tag, changes=_image_changes("/bin/sh"))
    return BuiltImage(BUSYBOX_TAG, _retire(client, BUSYBOX_TAG, existing), time.perf_counter() - started, built=True)


def build_debian_image(
    client: docker.DockerClient | None = None,
    *,
    var_dir: Path,
    force: bool = False,
    mirror: str = DEBIAN_MIRROR,
) -> BuiltImage:
    client = client or docker.from_env()
    started = time.perf_counter()
    existing = _existing(client, DEBIAN_TAG)
    if existing and not force:
        return BuiltImage(DEBIAN_TAG, existing, 0.0, built=False)
    tarball = _debian_rootfs_tarball(var_dir / "images", mirror)
    repository, tag = DEBIAN_TAG.split(":")
    client.api.import_image(src=str(tarball), repository=repository, tag=tag, changes=_image_changes("/bin/bash"))
    return BuiltImage(DEBIAN_TAG, _retire(client, DEBIAN_TAG, existing), time.perf_counter() - started, built=True)


def _existing(client: docker.DockerClient, tag: str) -> str | None:
    try:
        return client.images.get(tag).id
    except docker.errors.ImageNotFound:
        return None


def _retire(client: docker.DockerClient, tag: str, previous: str | None) -> str:
    """The new image id of `tag`; the image it replaced is removed unless something still uses it."""
    current = client.images.get(tag).id
    if previous and previous != current:
        try:
            client.images.remove(previous)
        except docker.errors.APIError:  # sandboxes or snapshots still build on it
            pass
    return current


def _image_changes(shell: str) -> list[str]:
    # The shell label spares the docker backend a probe of the first container of the image.
    return [
        f"LABEL {OWNER_LABEL}={OWNER} {SHELL_LABEL}={shell}",
        f"ENV PATH={_PATH}",
        "ENV HOME=/root",
        "ENV LANG=C.UTF-8",
        "WORKDIR /root",
        f'CMD ["{shell}"]',
    ]


def _busybox_rootfs_tar(busybox: Path) -> bytes:
    applets = subprocess.run([str(busybox), "--list-full"], check=True, capture_output=True, text=True).stdout.split()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder, mode in _BUSYBOX_DIRS.items():
            _add(tar, folder, tarfile.DIRTYPE, mode)
        _add(tar, "bin/busybox", tarfile.REGTYPE, 0o755, busybox.read_bytes())
        for applet in applets:
            if applet != "bin/busybox":
                _add(tar, applet, tarfile.SYMTYPE, 0o777, link="/bin/busybox")
        passwd = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        _add(tar, "etc/passwd", tarfile.REGTYPE, 0o644, passwd)
        _add(tar, "etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nnogroup:x:65534:\n")
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname, info.mtime = kind, mode, len(data), link, 0
    tar.addfile(info, io.BytesIO(data) if data else None)


def _debian_rootfs_tarball(cache_dir: Path, mirror: str) -> Path:
    """debootstrap once per (suite, mirror, package list); later builds reuse the tarball."""
    key = hashlib.sha256(repr((DEBIAN_SUITE, mirror, DEBIAN_PACKAGES)).encode()).hexdigest()[:12]
    tarball = cache_dir / f"debian-{DEBIAN_SUITE}-{key}.tar"
    if tarball.exists():
        return tarball
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".rootfs-") as workdir:
        rootfs = Path(workdir) / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(DEBIAN_PACKAGES)}",
                DEBIAN_SUITE,
                str(rootfs),
                mirror,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        _unmount_below(rootfs)  # a mount debootstrap could not undo (busy) is not the image's
        # Downloaded .debs and package lists are half the size and no use inside a sandbox.
        for leftover in [rootfs / "var/cache/apt/archives", rootfs / "var/lib/apt/lists"]:
            for path in leftover.glob("*"):
                if path.is_file():
                    path.unlink()
        partial = Path(workdir) / "rootfs.tar"
        subprocess.run(
            ["tar", "-C", str(rootfs), "--numeric-owner", "--one-file-system", "-cf", str(partial), "."], check=True
        )
        shutil.move(partial, tarball)
    return tarball


def _unmount_below(root: Path) -> None:
    """Detach what is still mounted under `root` (debootstrap mounts /proc in it and leaves it
    mounted when something held it busy), deepest first."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
