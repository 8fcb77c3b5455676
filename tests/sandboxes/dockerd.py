"""A dockerd of a test's own, beside the machine's engine (which is never touched): a socket, data
root, exec root, pidfile and bridge of its own under a short temporary folder. With --bridge=none
dockerd would delete the host's docker0 at start, so it gets a bridge of its own (no iptables
rules, no masquerading). Starting and stopping are bounded in time."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import docker

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


class SecondEngine:
    """stop() and start() restart it on the same data root; remove() stops it for good and takes
    its bridge and folder away."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="tvx-", dir="/tmp"))  # short: a unix socket path has 107 bytes
        self.url = f"unix://{self.root}/docker.sock"
        self.process: subprocess.Popen | None = None
        # Per test process: two sessions at once (other checkouts) never share a bridge or subnet.
        self.bridge = f"tvx{os.getpid() % 100000}"
        self.subnet = f"10.231.{os.getpid() % 254 + 1}.1/24"

    def bridge_up(self) -> None:
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode != 0:
            subprocess.run(["ip", "link", "add", "name", self.bridge, "type", "bridge"], check=True)
            subprocess.run(["ip", "addr", "add", self.subnet, "dev", self.bridge], check=True)
            subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True)

    def bridge_down(self) -> None:
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)

    def start(self) -> None:
        self.bridge_up()
        with open(self.root / "dockerd.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    "dockerd",
                    "--host",
                    self.url,
                    "--data-root",
                    str(self.root / "data"),
                    "--exec-root",
                    str(self.root / "exec"),
                    "--pidfile",
                    str(self.root / "docker.pid"),
                    f"--bridge={self.bridge}",
                    "--iptables=false",
                    "--ip-masq=false",
                    "--ip-forward=false",
                    "--shutdown-timeout",
                    "1",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                docker.DockerClient(base_url=self.url, timeout=5).ping()
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the second dockerd did not start: " + (self.root / "dockerd.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.3)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # its containers stop with it (no live restore)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its containerd too
            self.process.wait()

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            self.bridge_down()
            shutil.rmtree(self.root, ignore_errors=True)

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.url, timeout=30)
