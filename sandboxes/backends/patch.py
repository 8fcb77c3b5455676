"""A small, strict unified-diff applier for the directory backend's `apply_patch` tool.

Strict like `git apply` without fuzz: every context and removed line must match exactly; a hunk
may only move (an offset), never match approximately. A patch applies completely or not at all:
`plan_patch` computes every new file content in memory before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = "\\ No newline at end of file"


class PatchRejected(Exception):
    """The patch is malformed or does not match the files; nothing was changed."""


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_count: int
    old_lines: tuple[str, ...]
    new_lines: tuple[str, ...]


@dataclass(frozen=True)
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class FileChange:
    path: str
    content: str | None  # None: delete the file
    action: str  # "created", "patched", "deleted"


def plan_patch(patch: str, read: Callable[[str], str | None]) -> list[FileChange]:
    """The file changes `patch` makes, given `read(path)` -> content or None if absent."""
    file_patches = parse_unified_diff(patch)
    if not file_patches:
        raise PatchRejected("no file changes found in the patch")
    pending: dict[str, str | None] = {}

    def current(path: str) -> str | None:
        return pending[path] if path in pending else read(path)

    changes: list[FileChange] = []
    for fp in file_patches:
        changes.extend(_plan_file(fp, current, pending))
    return changes


def _plan_file(fp: FilePatch, current: Callable[[str], str | None], pending: dict[str, str | None]) -> list[FileChange]:
    source = fp.old_path or fp.new_path
    assert source is not None  # the parser rejects /dev/null on both sides
    original = current(fp.old_path) if fp.old_path else None
    if fp.old_path is None and current(source) is not None:
        raise PatchRejected(f"{source}: file already exists")
    if fp.old_path is not None and original is None:
        raise PatchRejected(f"{fp.old_path}: no such file")
    result = apply_hunks(original or "", fp.hunks, source)
    if fp.new_path is None:
        if result:
            raise PatchRejected(f"{source}: deleting patch leaves content behind")
        pending[source] = None
        return [FileChange(source, None, "deleted")]
    changes = []
    if fp.old_path is not None and fp.old_path != fp.new_path:
        pending[fp.old_path] = None
        changes.append(FileChange(fp.old_path, None, "deleted"))
    pending[fp.new_path] = result
    changes.append(FileChange(fp.new_path, result, "created" if fp.old_path is None else "patched"))
    return changes


def apply_hunks(original: str, hunks: tuple[Hunk, ...], path: str) -> str:
    old = _split_lines(original)
    out: list[str] = []
    cursor = 0
    for number, hunk in enumerate(hunks, start=1):
        # A hunk that removes nothing inserts *after* line old_start, others start *at* it.
        expected = hunk.old_start if hunk.old_count == 0 else hunk.old_start - 1
        pos = _find(old, hunk.old_lines, expected, cursor)
        if pos is None:
            raise PatchRejected(f"{path}: hunk {number} does not match the file (expected near line {expected + 1})")
        out.extend(old[cursor:pos])
        out.extend(hunk.new_lines)
        cursor = pos + len(hunk.old_lines)
    out.extend(old[cursor:])
    return "".join(out)


def _find(lines: list[str], needle: tuple[str, ...], expected: int, start: int) -> int | None:
    """The position >= start where `needle` matches exactly, nearest to `expected`."""
    last = len(lines) - len(needle)
    if not needle:
        return min(max(expected, start), len(lines))
    candidates = [p for p in range(start, last + 1) if tuple(lines[p : p + len(needle)]) == needle]
    return min(candidates, key=lambda p: (abs(p - expected), p), default=None)


def parse_unified_diff(patch: str) -> list[FilePatch]:
    # Only "\ No newline at end of file" says a line lacks its newline, not a missing final one.
    lines = _split_lines(patch if patch.endswith("\n") else patch + "\n")
    patches = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1  # "diff --git", "index", mode lines and prose are not needed
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchRejected(f"line {i + 1}: '---' header without a '+++' header")
        old_path, new_path = _paths(lines[i][4:], lines[i + 1][4:])
        hunks, i = _parse_hunks(lines, i + 2)
        if not hunks:
            raise PatchRejected(f"{new_path or old_path}: no hunks")
        patches.append(FilePatch(old_path, new_path, tuple(hunks)))
    return patches


def _paths(old_header: str, new_header: str) -> tuple[str | None, str | None]:
    old, new = _header_path(old_header), _header_path(new_header)
    if old is None and new is None:
        raise PatchRejected("a file patch cannot go from /dev/null to /dev/null")
    # git's a/ and b/ prefixes (what `patch -p1` strips), recognised only when both sides agree.
    if (old is None or old.startswith("a/")) and (new is None or new.startswith("b/")):
        old, new = old and old[2:], new and new[2:]
    return old, new


def _header_path(header: str) -> str | None:
    path = header.rstrip("\r\n").split("\t", 1)[0].rstrip()
    return None if path == "/dev/null" else path


def _parse_hunks(lines: list[str], i: int) -> tuple[list[Hunk], int]:
    hunks = []
    while i < len(lines) and lines[i].startswith("@@"):
        header = _HUNK_HEADER.match(lines[i])
        if not header:
            raise PatchRejected(f"line {i + 1}: malformed hunk header")
        old_start, old_count = int(header[1]), int(header[2] or 1)
        new_count = int(header[4] or 1)
        old_lines, new_lines, i = _parse_hunk_body(lines, i + 1, old_count, new_count)
        hunks.append(Hunk(old_start, old_count, tuple(old_lines), tuple(new_lines)))
        if _continues_hunk(lines, i):
            raise PatchRejected(f"line {i + 1}: hunk longer than its header says")
    return hunks, i


def _continues_hunk(lines: list[str], i: int) -> bool:
    """A body line right after a complete hunk means the header's counts are wrong."""
    if i >= len(lines) or lines[i][:1] not in (" ", "-", "+"):
        return False
    is_next_header = lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
    return not is_next_header


def _parse_hunk_body(lines: list[str], i: int, old_count: int, new_count: int) -> tuple[list[str], list[str], int]:
    if old_count == new_count == 0:
        raise PatchRejected(f"line {i}: empty hunk")
    old: list[str] = []
    new: list[str] = []
    last_kind = ""
    for line, kind in _body_lines(lines, i):
        i += 1
        if kind == "\\":
            _drop_final_newline(old, new, last_kind)
            continue
        if len(old) + (kind in " -") > old_count or len(new) + (kind in " +") > new_count:
            raise PatchRejected(f"line {i}: hunk longer than its header says")
        if kind in " -":
            old.append(line)
        if kind in " +":
            new.append(line)
        last_kind = kind
        if len(old) == old_count and len(new) == new_count:
            # A trailing "\ No newline" marker still belongs to this hunk.
            if i < len(lines) and lines[i].startswith(_NO_NEWLINE):
                _drop_final_newline(old, new, last_kind)
                i += 1
            return old, new, i
    raise PatchRejected("patch ends inside a hunk")


def _body_lines(lines: list[str], i: int) -> Iterator[tuple[str, str]]:
    for line in lines[i:]:
        if line.startswith(_NO_NEWLINE):
            yield "", "\\"
        elif line in ("\n", "\r\n"):
            yield line, " "  # a blank context line whose leading space was stripped (editors do)
        elif line[:1] in (" ", "-", "+"):
            yield line[1:], line[0]
        else:
            raise PatchRejected(f"unexpected line in hunk: {line.rstrip()[:80]!r}")


def _drop_final_newline(old: list[str], new: list[str], last_kind: str) -> None:
    if not last_kind:
        raise PatchRejected("'\\ No newline at end of file' before any line")
    for side, kinds in ((old, " -"), (new, " +")):
        if last_kind in kinds and side[-1].endswith("\n"):
            side[-1] = side[-1][:-1]


def _split_lines(text: str) -> list[str]:
    """Lines with their "\\n"; unlike str.splitlines, "\\r", form feeds etc. stay inside a line."""
    pieces = text.split("\n")
    lines = [piece + "\n" for piece in pieces[:-1]]
    return lines + [pieces[-1]] if pieces[-1] else lines
