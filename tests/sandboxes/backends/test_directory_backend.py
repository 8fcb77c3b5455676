"""The directory backend: tools over a folder, confinement, snapshots and forks as copies."""

from __future__ import annotations

import os
import subprocess

import pytest

from sandboxes.backends.base import (
    DiskQuotaExceeded,
    InvalidEnv,
    InvalidToolArgs,
    LimitExceeded,
    PathTooLong,
    SandboxGone,
    SandboxOverQuota,
    SnapshotMissing,
    ToolNotFound,
)
from sandboxes.backends.config import DirectoryConfig
from sandboxes.backends.directory import DirectoryBackend

ENV = {"backend": "directory", "files": {"README.md": "hello\n", "src/app.py": "x = 1\ny = 2\n"}}


@pytest.fixture
def sandbox(directory_backend):
    return directory_backend.start(ENV, labels={"tvcache.task": "t1"})


def call(sandbox, tool, **args):
    return sandbox.execute(tool, args)


def test_tools_read_write_and_list(sandbox):
    assert call(sandbox, "read_file", path="README.md") == {"output": "hello\n", "ok": True}
    assert call(sandbox, "write_file", path="docs/new.txt", content="née\n")["ok"] is True
    assert call(sandbox, "read_file", path="docs/new.txt")["output"] == "née\n"
    assert call(sandbox, "list_dir", path=".")["output"] == "README.md\ndocs/\nsrc/"
    assert call(sandbox, "list_dir", path="src")["output"] == "app.py"


def test_stale_read_sees_the_new_content(sandbox):
    assert call(sandbox, "read_file", path="README.md")["output"] == "hello\n"
    call(sandbox, "write_file", path="README.md", content="new\n")
    assert call(sandbox, "read_file", path="README.md")["output"] == "new\n"


def test_missing_files_are_results_not_errors(sandbox):
    assert call(sandbox, "read_file", path="nope.txt") == {"output": "no such file: nope.txt", "ok": False}
    assert call(sandbox, "list_dir", path="nope")["ok"] is False
    assert call(sandbox, "write_file", path="README.md/x", content="")["ok"] is False


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "src/../../outside.txt", "a\x00b"])
def test_paths_that_leave_the_folder_are_rejected(sandbox, tmp_path, path):
    for tool, args in [("read_file", {}), ("write_file", {"content": "x"}), ("list_dir", {})]:
        result = call(sandbox, tool, path=path, **args)
        assert result["ok"] is False
    assert not (tmp_path / "outside.txt").exists()


def test_symlink_escapes_are_rejected(directory_backend, sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    # Tools cannot make symlinks; plant one the way a tampered folder would hold it.
    files = directory_backend.sandboxes.path(sandbox.sandbox_id) / "files"
    os.symlink(tmp_path, files / "escape")
    assert call(sandbox, "read_file", path="escape/secret.txt")["ok"] is False
    assert call(sandbox, "write_file", path="escape/secret.txt", content="owned")["ok"] is False
    assert secret.read_text() == "host secret"


def test_seed_files_outside_the_folder_are_refused(directory_backend):
    with pytest.raises(InvalidEnv):
        directory_backend.start({"backend": "directory", "files": {"../x": "y"}}, labels={})
    with pytest.raises(InvalidEnv):
        directory_backend.start({"backend": "directory", "files": {"a": 1}}, labels={})


PATCH = """\
--- a/src/app.py
+++ b/src/app.py
@@ -1,2 +1,3 @@
 x = 1
-y = 2
+y = 20
+z = 3
--- /dev/null
+++ b/src/new.py
@@ -0,0 +1 @@
+print("new")
"""


def test_apply_patch_edits_and_creates_files(sandbox):
    result = call(sandbox, "apply_patch", patch=PATCH)
    assert result == {"output": "patched src/app.py\ncreated src/new.py", "ok": True}
    assert call(sandbox, "read_file", path="src/app.py")["output"] == "x = 1\ny = 20\nz = 3\n"
    assert call(sandbox, "read_file", path="src/new.py")["output"] == 'print("new")\n'


def test_apply_patch_with_wrong_context_changes_nothing(sandbox):
    call(sandbox, "write_file", path="src/app.py", content="x = 1\ny = 99\n")
    result = call(sandbox, "apply_patch", patch=PATCH)
    assert result["ok"] is False and "hunk 1" in result["output"]
    assert call(sandbox, "read_file", path="src/app.py")["output"] == "x = 1\ny = 99\n"
    assert call(sandbox, "read_file", path="src/new.py")["ok"] is False


def test_observed_calls_that_changed_nothing(sandbox):
    def changed(tool, **args):
        return sandbox.execute_observed(tool, args)[1]

    assert changed("read_file", path="README.md") is None  # read-only by declaration
    assert changed("write_file", path="README.md", content="hello\n") is False  # the content it holds
    assert changed("write_file", path="README.md", content="hello!\n") is None
    assert changed("write_file", path="README.md", content="hello!\n") is False
    assert changed("write_file", path="fresh.txt", content="") is None  # a new, empty file is a change
    assert changed("write_file", path="src", content="x") is False  # refused: a directory
    assert changed("write_file", path="../out.txt", content="x") is False  # refused: outside
    assert changed("apply_patch", patch=PATCH) is None
    assert changed("apply_patch", patch=PATCH) is False  # its context is gone: rejected
    assert call(sandbox, "read_file", path="src/app.py")["output"] == "x = 1\ny = 20\nz = 3\n"
    assert call(sandbox, "list_dir", path=".")["output"] == "README.md\nfresh.txt\nsrc/"


def test_apply_patch_cannot_write_outside(sandbox, tmp_path):
    patch = "--- /dev/null\n+++ b/../../escaped.txt\n@@ -0,0 +1 @@\n+x\n"
    assert call(sandbox, "apply_patch", patch=patch)["ok"] is False
    assert not (tmp_path / "escaped.txt").exists()


def test_snapshot_and_fork_are_independent_copies(directory_backend, sandbox):
    call(sandbox, "write_file", path="state.txt", content="v1")
    snap = sandbox.snapshot()
    assert snap.size_bytes == len("hello\n") + len("x = 1\ny = 2\n") + 2
    fork = directory_backend.fork(snap.ref, ENV, labels={"tvcache.task": "t1"})
    call(fork, "write_file", path="state.txt", content="fork")
    call(sandbox, "write_file", path="state.txt", content="parent")
    assert call(fork, "read_file", path="state.txt")["output"] == "fork"
    assert call(sandbox, "read_file", path="state.txt")["output"] == "parent"
    # The snapshot itself never changed.
    later = directory_backend.fork(snap.ref, ENV, labels={})
    assert call(later, "read_file", path="state.txt")["output"] == "v1"


def test_listing_labels_and_removal(directory_backend, sandbox):
    snap = sandbox.snapshot(labels={"tvcache.node": "3"})
    assert [s.id for s in directory_backend.list_sandboxes({"tvcache.task": "t1"})] == [sandbox.sandbox_id]
    assert directory_backend.list_sandboxes({"tvcache.task": "other"}) == []
    [listed] = directory_backend.list_snapshots({"tvcache.node": "3"})
    assert listed.id == snap.ref and listed.labels["tvcache.owner"] == "tvcache" and listed.created_at is not None
    sandbox.stop()
    sandbox.stop()
    assert not sandbox.alive() and directory_backend.list_sandboxes() == []
    with pytest.raises(SandboxGone):
        call(sandbox, "read_file", path="README.md")
    directory_backend.delete_snapshot(snap.ref)
    directory_backend.delete_snapshot(snap.ref)
    with pytest.raises(SnapshotMissing):
        directory_backend.fork(snap.ref, ENV, labels={})


def test_refs_cannot_name_paths(directory_backend):
    with pytest.raises(SnapshotMissing):
        directory_backend.fork("../sandboxes", ENV, labels={})
    directory_backend.remove_sandbox("../../")  # ignored, never a path


def test_unknown_tool_and_bad_args(sandbox):
    with pytest.raises(ToolNotFound):
        call(sandbox, "bash", command="ls")
    with pytest.raises(InvalidToolArgs):
        call(sandbox, "read_file")
    with pytest.raises(InvalidToolArgs):
        call(sandbox, "write_file", path="a.txt", content=None)


def test_policy_and_fingerprint(directory_backend):
    assert directory_backend.tools["read_file"].mutates_state is False
    assert directory_backend.tools["apply_patch"].mutates_state is True
    assert directory_backend.fingerprint_material(ENV)["tools_version"] >= 1
    assert directory_backend.health()["ok"] is True


def test_a_sandbox_holds_at_most_its_total_size(tmp_path):
    backend = DirectoryBackend(tmp_path, DirectoryConfig(max_total_bytes=100))
    sandbox = backend.start({"backend": "directory", "files": {"a": "x" * 40}}, labels={})
    assert call(sandbox, "write_file", path="b", content="y" * 50)["ok"] is True
    with pytest.raises(DiskQuotaExceeded) as over:
        call(sandbox, "write_file", path="c", content="z" * 20)
    assert over.value.code == "disk_quota_exceeded" and over.value.details["max_bytes"] == 100
    assert call(sandbox, "list_dir", path=".")["output"] == "a\nb"  # refused before anything was written
    assert call(sandbox, "write_file", path="b", content="y" * 60)["ok"] is True  # a rewrite counts its growth only
    patch = "--- /dev/null\n+++ b/d\n@@ -0,0 +1 @@\n+" + "p" * 30 + "\n"
    with pytest.raises(DiskQuotaExceeded):
        call(sandbox, "apply_patch", patch=patch)
    assert call(sandbox, "write_file", path="a", content="")["ok"] is True  # shrinking is always allowed
    assert call(sandbox, "apply_patch", patch=patch)["ok"] is True
    with pytest.raises(LimitExceeded) as seed:
        backend.start({"backend": "directory", "files": {"big": "x" * 101}}, labels={})
    assert seed.value.code == "limit_exceeded"


@pytest.mark.parametrize("path", ["n" * 256, "a/" * 520 + "f", "ok/" + "é" * 128])
def test_over_long_paths_are_a_clear_error(sandbox, path):
    # The host would answer ENAMETOOLONG (an unhandled OSError); the limits are the same on every host.
    for tool, args in (("write_file", {"content": "x"}), ("read_file", {}), ("list_dir", {})):
        with pytest.raises(PathTooLong) as refused:
            call(sandbox, tool, path=path, **args)
        assert refused.value.code == "path_too_long"


def test_seed_paths_are_held_to_the_same_lengths(directory_backend):
    with pytest.raises(PathTooLong):
        directory_backend.fingerprint_material({"backend": "directory", "files": {"n" * 256: "x"}})


def test_a_full_disk_is_a_clear_error(tmp_path):
    # A real full disk: a 64 KiB tmpfs under the sandboxes (the tests run as root).
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        backend = DirectoryBackend(mount)
        sandbox = backend.start({"backend": "directory", "files": {"a": "x"}}, labels={})
        with pytest.raises(SandboxOverQuota) as full:
            call(sandbox, "write_file", path="big", content="x" * 200_000)
        assert full.value.code == "disk_quota_exceeded" and isinstance(full.value, SandboxGone)
        with pytest.raises(DiskQuotaExceeded):  # a start that cannot copy its seed
            backend.start({"backend": "directory", "files": {"b": "x" * 100_000}}, labels={})
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_state_fingerprint_follows_the_files_across_forks(directory_backend, tmp_path):
    sandbox = directory_backend.start({"backend": "directory", "files": {"a.txt": "one"}}, labels={})
    sandbox.execute("write_file", {"path": "d/b.txt", "content": "two"})
    expected = sandbox.state_fingerprint()
    fork = directory_backend.fork(sandbox.snapshot().ref, {"backend": "directory"}, labels={})
    assert fork.state_fingerprint() == expected
    fork.execute("write_file", {"path": "d/b.txt", "content": "TWO"})
    assert fork.state_fingerprint() != expected
