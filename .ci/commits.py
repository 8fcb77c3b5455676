#!/usr/bin/env python3
"""Checks commit messages: `area: imperative summary` in at most 72 characters, a blank line, then
a body that says why (docs/contributing.md).

Checks the commits of a push: `.ci/commits.py BASE..HEAD`, or with no argument every commit after
the last one made before the rule (RULE_SINCE), so a fresh clone checks what any push added.
Merge commits are skipped: their messages are git's."""

from __future__ import annotations

import re
import subprocess
import sys

RULE_SINCE = "2e6b5d5f38bdf1f8f34cbe49f817657899b52289"
MAX_SUBJECT = 72
# An area (a package, a folder, a file's name, or several joined by commas), then a summary that
# starts in lower case with its verb.
SUBJECT = re.compile(r"[a-z0-9][a-z0-9_./-]*(, ?[a-z0-9][a-z0-9_./-]*)*: [a-z]\S* .+")


def problems(subject: str, body: str) -> list[str]:
    found = []
    if len(subject) > MAX_SUBJECT:
        found.append(f"subject is {len(subject)} characters, more than {MAX_SUBJECT}")
    if not SUBJECT.fullmatch(subject):
        found.append("subject is not `area: imperative summary` (lower-case area and verb)")
    if subject.endswith("."):
        found.append("subject ends with a full stop")
    if not body.strip():
        found.append("no body that says why")
    return found


def commits(revisions: str) -> list[tuple[str, str, str]]:
    out = subprocess.run(
        ["git", "log", "--no-merges", "--format=%H%x00%s%x00%b%x01", revisions],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(entry.strip("\n").split("\0", 2)) for entry in out.split("\1") if entry.strip()]


def main(argv: list[str]) -> int:
    known = subprocess.run(["git", "cat-file", "-e", f"{RULE_SINCE}^{{commit}}"], capture_output=True).returncode == 0
    # A shallow clone may lack the rule's start: then its newest commit is what the push added.
    revisions = argv[0] if argv else (f"{RULE_SINCE}..HEAD" if known else "-1")
    bad = 0
    for sha, subject, body in commits(revisions):
        for problem in problems(subject, body):
            bad += 1
            print(f"{sha[:12]} {subject!r}: {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
