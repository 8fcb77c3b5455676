"""The released frameworks tvclient integrates with, each in a virtualenv of its own.

A framework's venv is described by `lab/frameworks/specs/<name>.txt`: a `# python X.Y` line, then
one `pip install` argument list per line, run in order (so that `--no-deps` steps can keep pip
from resolving a CUDA build of torch). The venv is built once per description and Python
version, outside the checkout (`TVCACHE_FRAMEWORK_VENVS`, by default ~/.cache/tvcache/venvs), so
that fresh clones and later runs with nothing changed reuse it. tvclient is not installed into
it: drivers run with the checkout's `tvclient/src` on PYTHONPATH, so the code under test is
always the checkout's.

    python -m lab.frameworks.venvs [name ...]   # build (or find) the venvs, print their paths
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPECS = Path(__file__).resolve().parent / "specs"
DRIVERS = Path(__file__).resolve().parent  # the drivers: scripts run in a framework's venv
STALE_S = 3 * 86400
CACHE = Path(os.environ.get("TVCACHE_FRAMEWORK_VENVS", Path.home() / ".cache" / "tvcache" / "venvs"))


@dataclass(frozen=True)
class Framework:
    name: str
    python: str  # "3.11"
    steps: tuple[tuple[str, ...], ...]
    text: str

    @classmethod
    def named(cls, name: str) -> Framework:
        text = (SPECS / f"{name}.txt").read_text()
        python, steps = None, []
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("# python "):
                python = line.split()[-1]
            elif line and not line.startswith("#"):
                steps.append(tuple(shlex.split(line)))
        if python is None:
            raise ValueError(f"{name}.txt names no '# python X.Y'")
        return cls(name, python, tuple(steps), text)

    @property
    def interpreter(self) -> str:
        found = shutil.which(f"python{self.python}")
        candidates = [found] if found else []
        candidates += sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{self.python}.*/bin/python{self.python}"))
        )
        for candidate in candidates:
            if subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
                return candidate
        raise RuntimeError(f"{self.name} needs Python {self.python}, which this machine lacks")

    def venv(self) -> Path:
        """The framework's venv, built first if no run built it for this description."""
        interpreter = self.interpreter
        version = subprocess.run([interpreter, "--version"], capture_output=True, text=True).stdout.strip()
        key = hashlib.sha256(f"{version}\n{self.text}".encode()).hexdigest()[:16]
        target = CACHE / f"{self.name}-{key}"
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / f"{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # parallel runs build it once
            if not (target / "built").exists():
                self._build(interpreter, target)
                self._prune(keep=target)
        return target

    def _prune(self, keep: Path) -> None:
        """Drop this framework's venvs of older specs that no run has used for a few days."""
        for other in CACHE.glob(f"{self.name}-*"):
            marker = other / "built"
            stale = not marker.exists() or time.time() - marker.stat().st_atime > STALE_S
            if other != keep and other.is_dir() and stale:
                shutil.rmtree(other, ignore_errors=True)

    def _build(self, interpreter: str, target: Path) -> None:
        # Built in place (console scripts name their venv's path); `built` marks it complete.
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([interpreter, "-m", "venv", str(target)], check=True)
        pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        for step in self.steps:
            print(f"[{self.name}] pip install {' '.join(step)}", file=sys.stderr, flush=True)
            done = subprocess.run(pip + list(step), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            # pip's own complaints about the machine's index settings are not the build's news.
            print(
                "".join(
                    line for line in done.stderr.splitlines(keepends=True) if not line.startswith("WARNING: Location ")
                ),
                end="",
                file=sys.stderr,
            )
            done.check_returncode()
        (target / "built").write_text(self.text)

    def python_path(self) -> Path:
        venv = self.venv()
        os.utime(venv / "built")  # in use: not pruned
        return venv / "bin" / "python"

    def run(
        self, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `python args...` in the framework's venv with the checkout's tvclient importable."""
        variables = {**os.environ, **(env or {})}
        variables["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tvclient" / "src"), str(DRIVERS)])
        variables.pop("DJANGO_SETTINGS_MODULE", None)
        return subprocess.run(
            [str(self.python_path()), *args], env=variables, timeout=timeout, cwd=cwd, capture_output=True, text=True
        )


def all_names() -> list[str]:
    return sorted(path.stem for path in SPECS.glob("*.txt"))


if __name__ == "__main__":
    for name in sys.argv[1:] or all_names():
        print(Framework.named(name).venv())
