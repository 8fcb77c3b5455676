"""The documentation site builds strictly and needs no network to be viewed; the README stays a
front page whose two commands are the ones CI and the demo run (docs/getting-started/index.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# An asset the browser would fetch from another host: a script, a stylesheet, a font, an image.
REMOTE_ASSET = re.compile(
    r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["'](?:https?:)?//"""
    r"""|<link\b[^>]*\bhref=["'](?:https?:)?//"""
    r"""|url\(\s*["']?(?:https?:)?//"""
    r"""|@import\s+["'](?:https?:)?//""",
    re.IGNORECASE,
)
# Prose cites nothing a clone cannot follow: no tracker, no folder beside the repository.
FOREIGN_CITATION = re.compile(r"\bissues? #?\d+|\.\./shared|\bDESIGN\.md\b", re.IGNORECASE)


def test_the_site_builds_strictly_and_fetches_nothing_when_viewed(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr

    # The API reference is written from the OpenAPI schema at build time: every route is on a page.
    reference = "".join(p.read_text() for p in (site / "api" / "reference").glob("*.html"))
    for route in (
        "/api/v1/tasks/{task_id}/lookup",
        "/api/v1/tasks/{task_id}/record",
        "/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls",
        "/api/v1/upstreams/{name}",
    ):
        assert route in reference, route
    assert (site / "api" / "openapi.json").is_file()

    remote = [
        f"{page.relative_to(site)}: {match.group(0)}"
        for page in [*site.rglob("*.html"), *site.rglob("*.css")]
        for match in REMOTE_ASSET.finditer(page.read_text(errors="replace"))
    ]
    assert remote == []


def test_the_readme_is_a_front_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.MULTILINE | re.DOTALL)
    assert [b.strip() for b in blocks[:2]] == ["bash .ci/demo.sh", "bash .ci/test.sh"]
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("exec bash .ci/test.sh")


def test_the_prose_cites_nothing_outside_the_repository():
    pages = [ROOT / name for name in ("README.md", "CHANGELOG.md", "ARCHITECTURE.md")]
    pages += (ROOT / "docs").rglob("*.md")
    cited = [
        f"{page.relative_to(ROOT)}: {match.group(0)}"
        for page in pages
        if page.is_file()
        for match in FOREIGN_CITATION.finditer(page.read_text())
    ]
    assert cited == []
