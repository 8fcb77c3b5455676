"""The state a call left in the service's own sandbox, as its node keeps it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RecordedState:
    """What a node keeps of the sandbox after its call (docs/design/state.md):
    - `full`, `shape`, `order`: the state fingerprint's digests, which a sandbox materialized for the
      node is checked against ("" where the call ran elsewhere: client mode);
    - `file_times`: the modification times of what the call changed, written back after each
      replay of it (None: not kept);
    - `processes`: how many processes the sandbox kept running after it."""

    full: str = ""
    shape: str = ""
    order: str = ""
    file_times: Mapping[str, int] | None = None
    processes: int = 0
