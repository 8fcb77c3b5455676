"""The bfcl environment sees which calls of its state-changing tools changed nothing."""

from lab.replay.bfcl import BfclEnvironment, load_effects, load_entries, read_only_tools


def test_a_call_that_left_the_tool_state_as_it_was_is_observed_unchanged():
    entry = next(e for e in load_entries() if "GorillaFileSystem" in e["involved_classes"])
    env = BfclEnvironment(entry, read_only_tools(load_effects()))
    env.start()
    failed_cd = {"tool": "GorillaFileSystem.cd", "args": {"folder": "no_such_dir"}}
    result, changed = env.execute_observed(failed_cd)
    assert "No such file or directory" in result["output"] and changed is False
    assert env.execute_observed({"tool": "GorillaFileSystem.mkdir", "args": {"dir_name": "new"}})[1] is True
    # A read-only tool is not observed: the annotation decides.
    assert env.execute_observed({"tool": "GorillaFileSystem.ls", "args": {}})[1] is None
