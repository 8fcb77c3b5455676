"""Driver: how tvclient's Harbor integration takes the archives that carry downloads, in this
venv's Harbor. Crafted archives (as a corrupted or hostile graph could hold them) and staged
downloads (as a sandbox could leave them) are each given to the integration; a case is
`served` (its files written, nothing outside the target touched), or `refused` (the download
then runs live) with the target left exactly as it was. Prints one JSON document: {case:
{"outcome", "why", "untouched"}}, and for served ones the files the target then holds.

    python harbor_archives.py
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tvclient.integrations import harbor

# (name, type, mode, data or link target): tar members as written, without any check.
Member = tuple[str, bytes, int, str]
VALID: list[Member] = [
    (".", tarfile.DIRTYPE, 0o755, ""),
    ("notes", tarfile.DIRTYPE, 0o750, ""),
    ("notes/steps.txt", tarfile.REGTYPE, 0o600, "step 1\n"),
    ("latest", tarfile.SYMTYPE, 0, "notes/steps.txt"),
    ("notes/up", tarfile.SYMTYPE, 0, "../latest"),
]
ROOT = [(".", tarfile.DIRTYPE, 0o755, "")]
CRAFTED: dict[str, list[Member]] = {
    "absolute name": ROOT + [("/tmp/escaped", tarfile.REGTYPE, 0o644, "x")],
    "dot-dot name": ROOT + [("../escaped", tarfile.REGTYPE, 0o644, "x")],
    "dot-dot inside a name": ROOT
    + [("notes", tarfile.DIRTYPE, 0o755, ""), ("notes/../../escaped", tarfile.REGTYPE, 0o644, "x")],
    "child before its folder": ROOT + [("notes/steps.txt", tarfile.REGTYPE, 0o644, "x")],
    "absolute link": ROOT + [("passwd", tarfile.SYMTYPE, 0, "/etc/passwd")],
    "link leading outside": ROOT + [("up", tarfile.SYMTYPE, 0, "../outside")],
    "link through a link": ROOT + [("here", tarfile.SYMTYPE, 0, "."), ("up", tarfile.SYMTYPE, 0, "here/..")],
    "hard link": ROOT + [("hard", tarfile.LNKTYPE, 0o644, "/etc/passwd")],
    "device": ROOT + [("null", tarfile.CHRTYPE, 0o666, "")],
    "fifo": ROOT + [("pipe", tarfile.FIFOTYPE, 0o644, "")],
    "repeated name": ROOT + [("a", tarfile.REGTYPE, 0o644, "1"), ("a", tarfile.REGTYPE, 0o644, "2")],
    "root not a folder": [(".", tarfile.REGTYPE, 0o644, "x")],
    "not base64": None,  # type: ignore[dict-item]
}


def archive(members: list[Member]) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, mode, content in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            if kind == tarfile.REGTYPE:
                info.size = len(content.encode())
                tar.addfile(info, io.BytesIO(content.encode()))
            else:
                info.linkname = content
                tar.addfile(info)
    return base64.b64encode(gzip.compress(buffer.getvalue(), mtime=0)).decode()


def tree(root: Path) -> dict[str, Any]:
    """Every entry under `root` (and the outside marker), never following links."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        content = os.readlink(path) if path.is_symlink() else path.read_text() if path.is_file() else None
        found[path.relative_to(root).as_posix()] = [oct(stat.S_IMODE(info.st_mode)), stat.S_IFMT(info.st_mode), content]
    return found


def attempt(work: Path, encoded: str, *, prepare=None, file: bool = False) -> dict[str, Any]:
    """Unpack `encoded` into a fresh target (after `prepare(target)`); what happened."""
    case = Path(tempfile.mkdtemp(dir=work))
    (case / "outside").write_text("not to be touched\n")
    target = case / "target"
    if not file:
        target.mkdir()
    if prepare:
        prepare(target)
    before = tree(case)

    def outside() -> dict[str, Any]:
        return {
            name: entry for name, entry in tree(case).items() if name != "target" and not name.startswith("target/")
        }

    outside_before = outside()
    try:
        harbor._unpack(encoded, target, file=file)
    except harbor._Unservable as exc:
        return {"outcome": "refused", "why": str(exc), "untouched": tree(case) == before}
    return {"outcome": "served", "files": tree(target), "outside_untouched": outside() == outside_before}


def staged(work: Path, build, *, file: bool = False) -> dict[str, Any]:
    """What the integration records of a staged download that `build(root)` leaves."""
    root = Path(tempfile.mkdtemp(dir=work)) / "target"
    build(root)
    try:
        entries = harbor._entries(root, file=file, max_bytes=1 << 20)
    except harbor._Unservable as exc:
        return {"outcome": "refused", "why": str(exc)}
    again = harbor._entries(root, file=file, max_bytes=1 << 20)
    return {
        "outcome": "served",
        "entries": len(entries),
        "same_archive_twice": harbor._archive(entries) == harbor._archive(again),
    }


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="harbor-archives-") as work:
        print(json.dumps(cases(Path(work))))


def cases(work: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"crafted": {}, "targets": {}, "staged": {}}
    report["served"] = attempt(work, archive(VALID))
    for name, members in CRAFTED.items():
        report["crafted"][name] = attempt(work, archive(members) if members else "%%%")
    report["crafted"]["second member of a file download"] = attempt(
        work, archive([(".", tarfile.REGTYPE, 0o644, "x"), ("more", tarfile.REGTYPE, 0o644, "y")]), file=True
    )

    def link_in_the_way(target: Path) -> None:
        (target / "notes").symlink_to(target.parent / "outside-folder")
        (target.parent / "outside-folder").mkdir()

    def link_over_a_file(target: Path) -> None:
        (target / "notes").mkdir()
        (target / "notes" / "steps.txt").symlink_to(target.parent / "outside")

    def folder_where_a_file_goes(target: Path) -> None:
        (target / "notes").mkdir()
        (target / "notes" / "steps.txt").mkdir()

    for name, prepare in {
        "a link where a folder goes": link_in_the_way,
        "a link where a file goes": link_over_a_file,
        "a folder where a file goes": folder_where_a_file_goes,
    }.items():
        report["targets"][name] = attempt(work, archive(VALID), prepare=prepare)
    report["targets"]["an existing file is overwritten"] = attempt(
        work,
        archive(VALID),
        prepare=lambda target: (
            (target / "notes").mkdir(),
            (target / "notes" / "steps.txt").write_text("old\n"),
            (target / "keep.txt").write_text("trainer's\n"),
        ),
    )

    def outside_link(root: Path) -> None:
        root.mkdir()
        (root / "passwd").symlink_to("/etc/passwd")

    def fifo(root: Path) -> None:
        root.mkdir()
        os.mkfifo(root / "pipe")

    def ordinary(root: Path) -> None:
        (root / "notes").mkdir(parents=True)
        (root / "notes" / "steps.txt").write_text("step 1\n")
        (root / "latest").symlink_to("notes/steps.txt")

    report["staged"] = {
        "a link leading outside": staged(work, outside_link),
        "a fifo": staged(work, fifo),
        "files, folders and an inside link": staged(work, ordinary),
    }
    return report


if __name__ == "__main__":
    main()
