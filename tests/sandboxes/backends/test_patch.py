"""The strict unified-diff applier behind the directory backend's apply_patch."""

from __future__ import annotations

import pytest

from sandboxes.backends.patch import FileChange, PatchRejected, plan_patch

FILES = {"a.txt": "one\ntwo\nthree\nfour\nfive\n", "b.txt": "last line"}


def plan(patch: str) -> list[FileChange]:
    return plan_patch(patch, FILES.get)


def test_a_hunk_may_move_but_must_match_exactly():
    moved = "--- a.txt\n+++ a.txt\n@@ -1,2 +1,2 @@\n four\n-five\n+FIVE\n"
    assert plan(moved) == [FileChange("a.txt", "one\ntwo\nthree\nfour\nFIVE\n", "patched")]
    with pytest.raises(PatchRejected):
        plan("--- a.txt\n+++ a.txt\n@@ -1,2 +1,2 @@\n four \n-five\n+FIVE\n")


def test_no_newline_at_end_of_file_markers():
    patch = "--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-last line\n\\ No newline at end of file\n+last line\n"
    assert plan(patch) == [FileChange("b.txt", "last line\n", "patched")]


def test_delete_and_rename():
    delete = "--- a/b.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-last line\n\\ No newline at end of file\n"
    assert plan(delete) == [FileChange("b.txt", None, "deleted")]
    rename = "--- a/b.txt\n+++ b/c.txt\n@@ -1 +1 @@\n-last line\n\\ No newline at end of file\n+first line\n"
    assert plan(rename) == [FileChange("b.txt", None, "deleted"), FileChange("c.txt", "first line\n", "patched")]


def test_two_patches_of_one_file_apply_in_order():
    first = "--- a.txt\n+++ a.txt\n@@ -1 +1 @@\n-one\n+ONE\n"
    second = "--- a.txt\n+++ a.txt\n@@ -1 +1 @@\n-ONE\n+1\n"
    assert plan(first + second)[-1].content == "1\ntwo\nthree\nfour\nfive\n"


@pytest.mark.parametrize(
    "patch",
    [
        "just prose",
        "--- a.txt\n@@ -1 +1 @@\n-one\n+1\n",  # no +++ header
        "--- a.txt\n+++ a.txt\n@@ -1,2 +1 @@\n-one\n",  # ends inside the hunk
        "--- a.txt\n+++ a.txt\n@@ -1 +1 @@\n-one\n+1\n+2\n",  # longer than its header
        "--- /dev/null\n+++ a.txt\n@@ -0,0 +1 @@\n+x\n",  # creates an existing file
        "--- a/missing.txt\n+++ b/missing.txt\n@@ -1 +1 @@\n-x\n+y\n",
        "--- a.txt\n+++ a.txt\n@@ -1 +1 @@\n*one\n+1\n",
    ],
)
def test_malformed_or_mismatched_patches_are_rejected(patch):
    with pytest.raises(PatchRejected):
        plan(patch)
