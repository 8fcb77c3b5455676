"""The verl-tool caching proxy: a trainer that changes only its tool_server_url gets the upstream's
own answers, and the trajectories of a task share the results they can."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from cache.models import Node, Rollout
from cache.services import kept_history
from tests.support.upstreams import batch, close, interact, run, stats

pytestmark = pytest.mark.django_db(transaction=True)

BASH, CALC = r"<bash>(.*?)</bash>", r"<calc>(.*?)</calc>"


def bash_steps(who: str, task: str, *commands: str) -> list[tuple[str, dict]]:
    """A trajectory's actions: the model's reasoning differs from one trajectory to the next,
    the command in the tags does not; the dataset's extra fields come with every action."""
    return [
        (
            f"Step {i}, as {who} sees it: let me run this.\n<bash>{command}</bash>",
            {"task_id": task, "turns_left": 8 - i},
        )
        for i, command in enumerate(commands)
    ]


def test_a_trainer_gets_the_upstreams_answers_and_trajectories_of_a_task_share_them(api, verl_tool, proxy):
    shell = proxy("shell", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    calc = proxy(
        "calc",
        url=verl_tool.url,
        task_fields=["task_id"],
        action_pattern=CALC,
        read_only=True,
        ignore_fields=["turns_left"],
    )
    scripts = {
        "a": bash_steps("a", "t1", "echo one > f", "cat f", "echo two >> f", "cat f"),
        "b": bash_steps("b", "t1", "echo one > f", "cat f", "echo two >> f", "cat f"),  # a's, all of it
        "c": bash_steps("c", "t1", "echo one > f", "cat f", "echo three >> f", "cat f", "ls -a"),  # a's, then its own
        "d": bash_steps("d", "t2", "echo one > f", "cat f"),  # another task: nothing shared
    }
    sums = {"e": ["2+3", "7*6"], "f": ["7*6", "2+3"], "g": ["7*6", "1-9"]}  # read-only: in any order
    calcs = {
        who: [
            (f"I compute ({who}) <calc>{expr}</calc>", {"task_id": "c1", "turns_left": 8 - i})
            for i, expr in enumerate(exprs)
        ]
        for who, exprs in sums.items()
    }

    direct = {who: run(verl_tool.url, f"direct-{who}", steps) for who, steps in scripts.items()}
    direct |= {who: run(verl_tool.url, f"direct-{who}", steps) for who, steps in calcs.items()}
    proxied = {who: run(shell, f"proxy-{who}", steps) for who, steps in scripts.items()}
    proxied |= {who: run(calc, f"proxy-{who}", steps) for who, steps in calcs.items()}

    assert proxied == direct
    assert direct["c"][3][0]["obs"].startswith("one\nthree\n")  # the stale read is not a's "one\ntwo"
    assert direct["g"][1] == ("\n<result>-8</result>\n", False, True)
    # b was answered from the graph: the upstream saw only its finish.
    assert verl_tool.actions_received("proxy-b") == [""]
    # c's first two actions were hits; its first miss sent them first (its own raw actions).
    raw_c = [action for action, _ in scripts["c"]]
    assert verl_tool.actions_received("proxy-c") == [*raw_c, ""]
    assert verl_tool.actions_received("proxy-f") == [""]
    assert verl_tool.actions_received("proxy-g") == [calcs["g"][1][0], ""]
    shell_stats, calc_stats = stats(api, "shell"), stats(api, "calc")
    # hits: b 4, c 2; misses: a 4, c 3, d 2; each trajectory's finish passes through.
    assert {k: shell_stats[k] for k in ("hits", "misses", "passed_through", "upstream_errors")} == {
        "hits": 6,
        "misses": 9,
        "passed_through": 4,
        "upstream_errors": 0,
    }
    assert shell_stats["upstream_requests"] == 9 + 2 + 4  # the misses, c's catch-up, the finishes
    assert {k: calc_stats[k] for k in ("hits", "misses", "passed_through", "upstream_requests")} == {
        "hits": 3,
        "misses": 3,
        "passed_through": 3,
        "upstream_requests": 6,
    }


def test_a_batch_is_answered_in_one_response_and_its_misses_go_in_one_request(api, verl_tool, proxy):
    shell = proxy("batch", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    extra = [{"task_id": "t1", "turns_left": 3}, {"task_id": "t1", "turns_left": 3}, {"task_id": "t2", "turns_left": 3}]
    actions = [
        "<bash>echo hi > g; cat g</bash>",
        "so: <bash>echo hi > g; cat g</bash>",
        "<bash>echo hi > g; cat g</bash>",
    ]
    direct = batch(verl_tool.url, ["d1", "d2", "d3"], actions, extra)
    sent = verl_tool.request_count()
    proxied = batch(shell, ["p1", "p2", "p3"], actions, extra)
    assert proxied == direct
    # p1 and p2 make the same call in the same state: one of them asks the upstream, the other
    # takes its answer; p3's task is another. One request for both misses.
    assert verl_tool.request_count() == sent + 1
    assert verl_tool.requests[-1]["trajectory_ids"] == ["p1", "p3"]
    assert verl_tool.requests[-1]["extra_fields"] == [extra[0], extra[2]]
    assert {k: stats(api, "batch")[k] for k in ("hits", "misses")} == {"hits": 1, "misses": 2}
    # A batch with a miss that needs a catch-up (p2's) and one that does not (p3's).
    more = ["<bash>cat g; echo x >> g</bash>", "<bash>ls</bash>"]
    again_extra = [{"task_id": "t1", "turns_left": 2}, {"task_id": "t2", "turns_left": 2}]
    assert batch(shell, ["p2", "p3"], more, again_extra) == batch(verl_tool.url, ["d2", "d3"], more, again_extra)
    assert verl_tool.actions_received("p2") == [actions[1], more[0]]


def test_trajectories_missing_at_once_on_the_same_call_ask_the_upstream_once(api, verl_tool, proxy):
    shell = proxy("flight", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    action, extra = "<bash>sleep 0.5; echo slow > s; cat s</bash>", {"task_id": "t1"}
    answers, threads = {}, []
    for i in range(4):

        def go(i=i):
            answers[i] = interact(shell, f"r{i}", action, extra)

        threads.append(threading.Thread(target=go))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(answer == answers[0] for answer in answers.values()) and answers[0][0]["obs"].startswith("slow\n")
    assert sum(verl_tool.actions_received(f"r{i}") == [action] for i in range(4)) == 1
    assert {k: stats(api, "flight")[k] for k in ("hits", "misses")} == {"hits": 3, "misses": 1}


def test_an_action_the_pattern_does_not_match_passes_through_uncached(api, verl_tool, proxy):
    shell = proxy("mismatch", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    extra = {"task_id": "t1"}
    for trajectory in ("m1", "m2"):
        assert interact(shell, trajectory, "I will just answer.", extra) == (
            {"obs": "", "invalid_reason": "no valid tool found for action"},
            False,
            False,
        )
        assert verl_tool.actions_received(trajectory) == ["I will just answer."]
    assert {k: stats(api, "mismatch")[k] for k in ("hits", "misses", "passed_through")} == {
        "hits": 0,
        "misses": 0,
        "passed_through": 2,
    }


def test_an_action_the_upstream_marks_invalid_passes_through_and_stays_in_the_trajectorys_state(api, verl_tool, proxy):
    """The upstream keeps even an invalid action in the trajectory's env (verl-tool's tools do):
    what a trajectory reads after one is not what one that made none reads."""
    shell = proxy("invalid", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    extra = {"task_id": "t1"}
    invalid = (
        {"obs": "Your previous action is invalid: the command is empty.\n<reminder>You have 0 turns left.</reminder>"},
        False,
        False,
    )
    assert interact(shell, "i1", "<bash></bash>", extra) == invalid
    assert interact(shell, "i2", "<bash></bash>", extra) == invalid  # not served from the cache
    assert verl_tool.actions_received("i2") == ["<bash></bash>"]
    assert interact(shell, "i1", "<bash>cat .turns</bash>", extra)[0]["obs"].startswith("2\n")
    assert interact(shell, "i3", "<bash>cat .turns</bash>", extra)[0]["obs"].startswith("1\n")  # a miss
    assert verl_tool.actions_received("i3") == ["<bash>cat .turns</bash>"]
    assert stats(api, "invalid")["hits"] == 0


def test_finish_is_forwarded_and_ends_the_rollout(api, verl_tool, proxy):
    shell = proxy("finish", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    interact(shell, "f1", "<bash>echo kept > k</bash>", {"task_id": "t1"})
    answer = close(shell, "f1")
    assert (answer["observations"], answer["dones"], answer["valids"]) == ([""], [True], [True])
    assert verl_tool.actions_received("f1")[-1] == "" and "f1" not in verl_tool.envs  # its env dropped
    assert Rollout.objects.get(rollout_id="f1").finished_at is not None
    # The id seen again is a new trajectory: nothing of the old one carries over.
    seen = interact(shell, "f1", "<bash>ls</bash>", {"task_id": "t1"})
    assert seen == interact(verl_tool.url, "fresh", "<bash>ls</bash>", {"task_id": "t1"})
    again = Rollout.objects.get(rollout_id="f1")
    history = kept_history(again.pk, again.history_length)
    assert [call.args["action"] for call in history] == ["ls"] and again.finished_at is None


def test_the_last_step_ends_the_rollout(api, verl_tool, proxy):
    shell = proxy("last", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    interact(shell, "l1", "<bash>true</bash>", {"task_id": "t1"}, is_last_step=True)
    assert Rollout.objects.get(rollout_id="l1").finished_at is not None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_upstream_that_is_down_is_answered_as_verl_tools_server_answers_a_failed_tool(api, proxy, caplog):
    down = proxy(
        "down", url=f"http://127.0.0.1:{_closed_port()}/get_observation", task_fields=["task_id"], action_pattern=BASH
    )
    with caplog.at_level(logging.ERROR, logger="tvcache.upstreams"):
        observation, done, valid = interact(down, "x1", "<bash>ls</bash>", {"task_id": "t1"})
    assert (done, valid, observation["obs"]) == (True, False, "")
    assert observation["error"].startswith("Tool processing failed: upstream 'down' did not answer: ConnectError")
    assert "upstream down (http://127.0.0.1:" in caplog.text and "x1" in caplog.text
    assert Rollout.objects.get(rollout_id="x1").detached_at is not None
    assert {k: stats(api, "down")[k] for k in ("upstream_requests", "upstream_errors", "misses")} == {
        "upstream_requests": 1,
        "upstream_errors": 1,
        "misses": 1,
    }


def test_a_timeout_takes_the_trajectory_off_the_shared_graph(api, verl_tool, proxy):
    shell = proxy("slow", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH, timeout_s=0.3)
    extra = {"task_id": "t1"}
    interact(shell, "s1", "<bash>echo a > a</bash>", extra)
    observation, done, valid = interact(shell, "s2", "<bash>sleep 1; echo b > b</bash>", extra)
    assert (done, valid) == (True, False) and "no answer within 0.3 s" in observation["error"]
    assert Rollout.objects.get(rollout_id="s2").detached_at is not None
    # s2's next action was s1's, in the state s1 had; s2's state is unknown: it goes to the upstream.
    answer = interact(shell, "s2", "<bash>echo a > a</bash>", extra)
    assert answer[2] is True and verl_tool.actions_received("s2")[-1] == "<bash>echo a > a</bash>"
    assert Node.objects.filter(task__env__upstream="slow").count() == 1  # nothing of s2 recorded


def test_a_tool_that_fails_part_way_takes_the_trajectory_off_the_shared_graph(api, verl_tool, proxy):
    shell = proxy("crash", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    answer = interact(shell, "c1", "<bash>crash</bash>", {"task_id": "t1"})
    assert answer == ({"obs": "", "error": "Tool processing failed: the bash session died"}, True, False)
    assert Rollout.objects.get(rollout_id="c1").detached_at is not None


def test_an_upstream_down_at_a_catch_up_takes_the_trajectory_off_the_shared_graph(api, verl_tool, proxy, caplog):
    shell = proxy("catchup", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    extra = {"task_id": "t1"}
    interact(shell, "k1", "<bash>echo a > a</bash>", extra)
    assert interact(shell, "k2", "so <bash>echo a > a</bash>", extra)[2] is True  # a hit: pending for the upstream
    verl_tool.httpd.shutdown()
    verl_tool.httpd.server_close()
    with caplog.at_level(logging.ERROR, logger="tvcache.upstreams"):
        observation, done, valid = interact(shell, "k2", "<bash>ls</bash>", extra)
    assert (done, valid) == (True, False) and "ConnectError" in observation["error"]
    assert Rollout.objects.get(rollout_id="k2").detached_at is not None
    assert "failed for trajectories k2" in caplog.text


def test_a_changed_configuration_takes_live_trajectories_off_the_shared_graph(api, verl_tool, proxy):
    shell = proxy("moved", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    interact(shell, "n1", "<bash>echo a > a</bash>", {"task_id": "t1"})
    close(shell, "n1")
    interact(shell, "n2", "<bash>echo a > a</bash>", {"task_id": "t1"})
    response = api.put(
        "/api/v1/upstreams/moved",
        {
            "protocol": "verl-tool",
            "url": f"http://127.0.0.1:{_closed_port()}/x",
            "task_fields": ["task_id"],
            "action_pattern": BASH,
        },
        format="json",
    )
    assert response.status_code == 200
    # n2's env is on the old server: its history means nothing to the new one. n1 had ended.
    assert Rollout.objects.get(rollout_id="n2").detached_at is not None
    assert Rollout.objects.get(rollout_id="n1").detached_at is None


def test_a_response_has_verl_tools_timing_fields(api, verl_tool, proxy):
    shell = proxy("timing", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    answer = close(shell, "z1")
    assert set(answer) == {"observations", "dones", "valids", "processing_time_ms", "queue_time_ms"}
    assert isinstance(answer["processing_time_ms"], float) and isinstance(answer["queue_time_ms"], float)


def test_a_trajectorys_actions_in_one_request_are_served_in_order(api, verl_tool, proxy):
    shell = proxy("order", url=verl_tool.url, task_fields=["task_id"], action_pattern=BASH)
    extra = [{"task_id": "t1"}] * 3
    first = batch(
        shell, ["o1", "o2", "o1"], ["<bash>echo 1 > a</bash>", "<bash>echo 1 > a</bash>", "<bash>cat a</bash>"], extra
    )
    assert [answer[0]["obs"].split("\n")[0] for answer in first] == ["", "", "1"]
    assert verl_tool.actions_received("o2") == []  # o1's write, in the graph by then
