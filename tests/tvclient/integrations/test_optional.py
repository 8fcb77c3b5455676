"""The integrations are optional extras: tvclient and its integrations package import none of
the frameworks, and each integration module imports only its own."""

import subprocess
import sys

FRAMEWORKS = ("skyrl_gym", "verl", "tinker", "tinker_cookbook", "harbor")


def imported_frameworks(statement: str) -> list[str]:
    probe = f"import sys; {statement}; print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    output = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return [name for name in output.stdout.strip().split(",") if name]


def test_importing_tvclient_needs_no_framework():
    assert imported_frameworks("import tvclient, tvclient.integrations") == []


def test_an_integration_imports_its_own_framework_only():
    assert imported_frameworks("import tvclient.integrations.skyrl") == ["skyrl_gym"]
