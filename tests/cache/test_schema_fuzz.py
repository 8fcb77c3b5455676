"""Schemathesis over the whole OpenAPI schema (/api/schema/) against a served instance (the
deployed ASGI application, production settings): the examples, coverage and fuzzing phases,
bounded in time. Whatever it sends, the service answers 2xx or 4xx, never a server error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from django.conf import settings

from lab.server import service_running
from tests.support.api import call, lookup, record

pytestmark = pytest.mark.django_db(transaction=True)

FUZZ_S = 50  # schemathesis's budget; with the server's start, the test stays within 90 s
# One worker: schemathesis's threads trip a CPython 3.11 race in hypothesis's lambda parsing ("AST
# constructor recursion depth mismatch", a runtime error of the tool, not of the service).
# Concurrent requests have tests of their own (test_concurrency.py).
WORKERS = 1


@pytest.mark.slow
def test_the_whole_schema_fuzzed_finds_no_server_error(api, toy_task, token, tmp_path):
    # Ids that exist, drawn half of the time, so that operations get past their 404s.
    write = call("write", path="f", content="1")
    node = record(api, toy_task, [], write, {"ok": True})["node_id"]
    lookup(api, toy_task, [], write, rollout_id="r1")
    config = tmp_path / "schemathesis.toml"
    config.write_text(f"""
[dictionaries.task_ids]
values = ["{toy_task}"]

[dictionaries.node_ids]
values = [{node}]

[dictionaries.rollout_ids]
values = ["r1"]

[parameters]
"path.task_id" = {{ dictionary = "task_ids", probability = 0.5 }}
"path.node_id" = {{ dictionary = "node_ids", probability = 0.5 }}
"path.rollout_id" = {{ dictionary = "rollout_ids", probability = 0.5 }}
""")
    report = tmp_path / "junit.xml"
    with service_running(db=settings.DATABASES["default"], workers=1) as service:
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "--config-file",
                str(config),
                "run",
                f"{service.url}/api/schema/",
                "--phases",
                "examples,coverage,fuzzing",
                "--checks",
                "not_a_server_error",
                "--max-time",
                str(FUZZ_S),
                "--workers",
                str(WORKERS),
                "--header",
                f"Authorization: Token {token}",
                "--report",
                "junit",
                "--report-junit-path",
                str(report),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=FUZZ_S + 25,
        )  # its cache stays out of the repo
    operations = ElementTree.parse(report).getroot().iter("testcase")
    outcomes = {
        case.get("name"): [(o.tag, o.get("message")) for o in case if o.tag in ("failure", "error")]
        for case in operations
    }
    assert len(outcomes) >= 10 and not any(outcomes.values()), (outcomes, run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and " generated" in run.stdout
