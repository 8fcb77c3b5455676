import subprocess
import sys

import pytest

from tvclient import FolderEnvironment, InMemoryEnvironment, UnknownTool

from .fake_service import call


def test_in_memory_tools_and_their_declared_effects():
    env = InMemoryEnvironment({"a": "1"})
    env.start()

    assert env.execute(call("append", key="a", value="2")) == {"value": "12"}
    assert env.execute(call("set", key="b", value="x")) == {"value": "x"}
    assert env.execute(call("get", key="a")) == {"value": "12"}
    assert env.execute(call("list")) == {"keys": ["a", "b"]}
    assert env.executions == 4
    assert [env.mutates_state(call(tool)) for tool in ("get", "list", "set", "append")] == [
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(UnknownTool):
        env.execute(call("delete", key="a"))


def test_in_memory_fork_is_independent():
    env = InMemoryEnvironment()
    env.start()
    env.execute(call("set", key="a", value="1"))

    twin = env.fork()
    twin.execute(call("append", key="a", value="2"))

    assert env.data == {"a": "1"} and twin.data == {"a": "12"}
    assert twin.running and twin.executions == 1


@pytest.fixture
def folder(tmp_path):
    env = FolderEnvironment({"src/main.py": "print(1)\n"}, root=tmp_path)
    env.start()
    yield env
    env.stop()


def test_folder_tools(folder, tmp_path):
    assert folder.path.parent == tmp_path
    assert folder.execute(call("read_file", path="src/main.py")) == {
        "output": "print(1)\n",
        "ok": True,
    }
    assert folder.execute(call("write_file", path="docs/a.md", content="hi"))["ok"]
    assert folder.execute(call("list_dir", path="")) == {"output": "docs/\nsrc/", "ok": True}
    assert folder.execute(call("list_dir", path="docs")) == {"output": "a.md", "ok": True}
    assert folder.executions == 4
    assert not folder.mutates_state(call("read_file", path="x"))
    assert not folder.mutates_state(call("list_dir", path="x"))
    assert folder.mutates_state(call("write_file", path="x", content=""))


def test_folder_observes_a_write_of_the_same_content_as_no_change(folder):
    same = folder.execute_observed(call("write_file", path="src/main.py", content="print(1)\n"))
    assert same == ({"output": "wrote 9 characters to src/main.py", "ok": True}, False)
    assert folder.execute_observed(call("write_file", path="src/main.py", content="print(2)\n"))[1] is None
    assert folder.execute_observed(call("write_file", path="new.txt", content=""))[1] is None  # a new file
    assert folder.execute_observed(call("read_file", path="new.txt"))[1] is None  # declared read-only


def test_folder_failure_output_does_not_depend_on_where_the_folder_is(folder):
    answer = folder.execute(call("read_file", path="missing.txt"))

    assert answer == {"output": "missing.txt: No such file or directory", "ok": False}


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "src/../../x"])
def test_folder_refuses_paths_outside_it(folder, path):
    answer = folder.execute(call("write_file", path=path, content="x"))

    assert answer == {"output": f"{path}: outside the sandbox folder", "ok": False}
    assert not (folder.path.parent / "outside.txt").exists()


def test_folder_seed_outside_it_is_refused(tmp_path):
    with pytest.raises(ValueError):
        FolderEnvironment({"../x": ""}, root=tmp_path).start()


def test_folder_fork_copies_and_stop_removes(folder):
    twin = folder.fork()
    twin.execute(call("write_file", path="src/main.py", content="print(2)\n"))

    assert folder.execute(call("read_file", path="src/main.py"))["output"] == "print(1)\n"
    assert twin.path != folder.path and twin.executions == 1
    twin_path = twin.path
    twin.stop()
    assert not twin_path.exists() and not twin.running


def test_package_imports_no_django():
    probe = "import sys, tvclient; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout

    assert "django" not in loaded and "rest_framework" not in loaded
