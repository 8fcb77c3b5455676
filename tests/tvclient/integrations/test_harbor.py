"""Harbor 0.25.0 and 0.26.0 as released, each in its own venv (lab/frameworks/specs/harbor-*.txt),
against the served tvcache: the real `harbor run` runs Harbor's oracle agent and verifier on a
tiny task (lab/frameworks/harbor_task.py) in an environment whose sandbox is a folder
(lab/frameworks/harbor_local.py), uncached, then through tvcache twice with the command of
docs/integrations/harbor.md (lab/frameworks/harbor_trials.py)."""

import json
import re
import tempfile
from pathlib import Path

import pytest

from lab.frameworks.venvs import DRIVERS, ROOT, Framework

pytestmark = pytest.mark.slow  # a venv of the framework's own, driven in a subprocess

DOC = ROOT / "docs" / "integrations" / "harbor.md"
RELEASES = ("harbor-0.25", "harbor-0.26")
# What differs between any two uncached trials: ids, names, the job's folder and times. The
# comparison of cached and uncached trial folders leaves out these JSON fields and nothing else
# (two plain trials run at once may agree on one of the times by chance: it is left out all the same).
VARYING = [
    "/config.json/json/job_id",
    "/config.json/json/trial_name",
    "/config.json/json/trials_dir",
    "/result.json/json/agent_execution/finished_at",
    "/result.json/json/agent_execution/started_at",
    "/result.json/json/agent_setup/finished_at",
    "/result.json/json/agent_setup/started_at",
    "/result.json/json/config/job_id",
    "/result.json/json/config/trial_name",
    "/result.json/json/config/trials_dir",
    "/result.json/json/environment_setup/finished_at",
    "/result.json/json/environment_setup/started_at",
    "/result.json/json/finished_at",
    "/result.json/json/id",
    "/result.json/json/started_at",
    "/result.json/json/trial_name",
    "/result.json/json/trial_uri",
    "/result.json/json/verifier/finished_at",
    "/result.json/json/verifier/started_at",
]
# The folders a trial's files land in, as Harbor writes them (and the cached trials must too).
TRIAL_FILES = {
    "agent/oracle.txt",
    "agent/notes/steps.txt",
    "agent/latest-steps",
    "verifier/reward.txt",
    "verifier/test-stdout.txt",
    "verifier/details/report.txt",
    "artifacts/manifest.json",
    "result.json",
    "config.json",
    "trial.log",
}


def served(tvcache, **variables):
    return {"TVCACHE_URL": tvcache.url, "TVCACHE_TOKEN": tvcache.token, **variables}


def doc_block(title: str) -> str:
    found = re.search(rf'^```\w+ title="{re.escape(title)}"\n(.*?)^```', DOC.read_text(), re.MULTILINE | re.DOTALL)
    assert found, f"docs/integrations/harbor.md has no {title} block"
    return found.group(1)


def trials(release: str, tvcache, **variables) -> dict:
    """The driver's uncached, first and repeat passes, the cached ones by the docs' command."""
    done = Framework.named(release).run(
        [
            str(DRIVERS / "harbor_trials.py"),
            "--passes",
            "uncached,first,repeat",
            "--command",
            doc_block("cached-trial.sh"),
            "--varying",
            ",".join(VARYING),
        ],
        env=served(tvcache, **variables),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for name, result in report["passes"].items():
        for run in result["runs"]:
            assert run["returncode"] == 0, (name, run["output"])
    return report


def operations(entries: list[dict], session: str | None = None) -> list[tuple]:
    return [
        (entry["operation"], entry.get("command") or entry.get("source") or entry.get("target"))
        for entry in entries
        if session is None or entry["session"] == session
    ]


def timings(release: str, report: dict) -> str:
    passes = report["passes"]
    return (
        f"{release}: trial {[t['trial_s'] for t in passes['uncached']['trials']]} s uncached, "
        f"{passes['first']['trials'][0]['trial_s']} s first, {passes['repeat']['trials'][0]['trial_s']} s repeat; "
        f"harbor run {[r['wall_s'] for r in passes['uncached']['runs']]} s uncached, "
        f"{passes['first']['wall_s']} s first, {passes['repeat']['wall_s']} s repeat"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("release", RELEASES)
def test_cached_trials_are_the_uncached_trial_and_the_repeat_runs_nothing(release, tvcache):
    report = trials(release, tvcache)
    passes = report["passes"]
    print(timings(release, report))

    # Cached<Type> import paths resolve through Harbor's own machinery (0.25 has no
    # EnvironmentFactory.get_environment_class: they all failed there).
    assert report["import_paths"]["tvclient.integrations.harbor:CachedDocker"] == {
        "class": "CachedDockerEnvironment",
        "bases": ["TVCacheEnvironment", "DockerEnvironment"],
        "environment": True,
    }
    assert all(resolved.get("environment") for resolved in report["import_paths"].values()), report["import_paths"]

    uncached = passes["uncached"]["trials"]
    assert len(uncached) == 2 and {entry["trial_name"] for entry in uncached}.isdisjoint(
        {passes["first"]["trials"][0]["trial_name"], passes["repeat"]["trials"][0]["trial_name"]}
    )
    for entry in uncached:
        assert entry["reward"] == {"reward": 1.0} and entry["exception"] is None
        assert TRIAL_FILES <= set(entry["files"]), sorted(entry["files"])
    assert uncached[0]["files"]["agent/notes/steps.txt"]["mode"] == "0o600"  # modes are the sandbox's
    assert uncached[0]["files"]["agent/latest-steps"] == {"mode": "0o777", "kind": "link", "target": "notes/steps.txt"}

    # Every file of the cached trials' folders, byte for byte and mode for mode, but the fields
    # that differ between the two uncached trials too.
    assert set(report["varying"]) <= set(VARYING)  # nothing else differs between two plain trials
    assert report["differences"] == {"first": [], "repeat": []}
    for name in ("first", "repeat"):
        assert passes[name]["trials"][0]["reward"] == {"reward": 1.0}
        assert set(passes[name]["trials"][0]["files"]) == set(uncached[0]["files"])

    # solve.sh runs once per uncached trial, once in the first cached trial, never in the repeat.
    assert [passes[name]["solve_runs"] for name in ("uncached", "first", "repeat")] == [2, 1, 0]
    one_trial = operations(passes["uncached"]["sandbox_operations"], f"{uncached[0]['trial_name']}__env")
    assert operations(passes["first"]["sandbox_operations"]) == one_trial  # no replay, nothing more
    assert passes["repeat"]["sandbox_operations"] == []  # nothing after start(): no call, no replay
    calls = len(one_trial)
    assert calls == 13
    assert passes["first"]["service"] | {"saved_ms": 0} == {
        "calls": calls,
        "hits": 0,
        "executions": calls,
        "saved_ms": 0,
    }
    assert passes["repeat"]["service"] | {"saved_ms": 0} == {
        "calls": calls,
        "hits": calls,
        "executions": 0,
        "saved_ms": 0,
    }


@pytest.mark.django_db(transaction=True)
def test_a_download_too_large_to_record_runs_live_after_the_catch_up(tvcache):
    """A result limit too small for any archive: the downloads run live in the sandbox, which
    first catches up (solve.sh runs again), and the trial is still the uncached one."""
    report = trials("harbor-0.26", tvcache, TVCACHE_MAX_RESULT_BYTES="64")
    passes = report["passes"]
    print(timings("harbor-0.26 (downloads live)", report))
    assert set(report["varying"]) <= set(VARYING)  # nothing else differs between two plain trials
    assert report["differences"] == {"first": [], "repeat": []}
    assert [passes[name]["solve_runs"] for name in ("uncached", "first", "repeat")] == [2, 1, 1]
    ran = operations(passes["repeat"]["sandbox_operations"])
    downloads = [entry for entry in ran if entry[0].startswith("download")]
    assert [source for _, source in downloads] == [
        "/logs/agent/oracle.txt",
        "/logs/agent",
        "/logs/artifacts",
        "/logs/verifier",
    ]
    assert ("exec", "(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1") in ran  # the catch-up
    assert passes["repeat"]["service"]["executions"] == len(downloads)  # download_live, uncacheable


@pytest.mark.parametrize("release", RELEASES)
def test_archives_are_taken_only_where_they_are_safe(release):
    done = Framework.named(release).run([str(DRIVERS / "harbor_archives.py")])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["served"]["outside_untouched"] and report["served"]["files"] == {
        "latest": ["0o777", 0o120000, "notes/steps.txt"],
        "notes": ["0o750", 0o040000, None],
        "notes/steps.txt": ["0o600", 0o100000, "step 1\n"],
        "notes/up": ["0o777", 0o120000, "../latest"],
    }
    for case in (*report["crafted"], *[name for name in report["targets"] if name.startswith("a ")]):
        outcome = report["crafted"].get(case) or report["targets"][case]
        assert outcome["outcome"] == "refused" and outcome["untouched"], (case, outcome)
    overwritten = report["targets"]["an existing file is overwritten"]
    assert overwritten["outcome"] == "served" and overwritten["outside_untouched"]
    assert overwritten["files"]["notes/steps.txt"] == ["0o600", 0o100000, "step 1\n"]
    assert overwritten["files"]["keep.txt"] == ["0o644", 0o100000, "trainer's\n"]  # not the download's: stays
    assert report["staged"]["a link leading outside"]["outcome"] == "refused"
    assert report["staged"]["a fifo"]["outcome"] == "refused"
    assert report["staged"]["files, folders and an inside link"] == {
        "outcome": "served",
        "entries": 4,
        "same_archive_twice": True,
    }


@pytest.mark.parametrize("release", RELEASES)
def test_the_docs_job_config_is_harbors(release):
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "job.yaml"
        config.write_text(doc_block("job.yaml"))
        done = Framework.named(release).run(
            ["-m", "harbor.cli.main", "run", "-c", str(config), "--print-config"], env={"HARBOR_TELEMETRY": "0"}
        )
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = json.loads(done.stdout)  # 0.25 prints only what differs from the defaults
    assert resolved["environment"]["import_path"] == "tvclient.integrations.harbor:CachedDocker"
    assert [task["path"] for task in resolved["tasks"]] == ["path/to/task"]
