"""The Docker engines a deployment runs sandboxes on (TVCACHE_DOCKER_ENGINES, "URL=CAPACITY,...";
unset: the one engine of TVCACHE_DOCKER_URL).

- A sandbox row records its engine (`Sandbox.engine`), a snapshot the engine holding its image
  (`Snapshot.engine`): an engine's name is its URL, "" for the one engine of a deployment that
  names none.
- A fresh sandbox goes to the engine whose live sandboxes are the smallest share of its capacity;
  a fork to its snapshot's engine. Capacity is a share, not an admission limit (a project's grant
  of live sandboxes is): a deployment whose engines are all full still places by share.
- Every engine runs the first engine's images, by id (DockerConfig.images_from): an env
  fingerprint names one image whichever engine a sandbox lands on.
- An engine that failed is left out of placements for a while (this process's view); its
  sandboxes are gone (runtime.py). New sandboxes fail only when no engine can take them.
- With several engines, background work on an engine's sandboxes (warming, collecting snapshots,
  audits) goes to a Celery queue of its own, `<default queue>.<engine queue>`, consumed by the
  workers next to that engine.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count

from sandboxes.models import Sandbox

log = logging.getLogger("tvcache.sandboxes")

ENGINE_RETRY_S = 10.0  # an engine that failed is tried again for new sandboxes after this long
_ENTRY = re.compile(r"(?P<url>\S+)=(?P<capacity>[1-9]\d*)")
_lost: dict[str, float] = {}  # engine name -> until when placements leave it out


@dataclass(frozen=True)
class Engine:
    name: str  # what rows record: its URL, or "" for the one engine of a deployment that names none
    url: str  # where it answers; "": DOCKER_HOST or the local socket
    capacity: int | None  # the sandboxes it is sized for; None: not declared (the only engine)
    queue: str | None  # its Celery queue, below the default one; None: the default queue

    @property
    def label(self) -> str:
        return self.url or "DOCKER_HOST or the local socket"


def engines() -> tuple[Engine, ...]:
    """The deployment's engines, the first holding the images every engine runs."""
    conf = settings.TVCACHE
    return _parsed(tuple(conf["DOCKER_ENGINES"]), conf["DOCKER_URL"])


@functools.lru_cache(maxsize=4)
def _parsed(entries: tuple[str, ...], single_url: str) -> tuple[Engine, ...]:
    if not entries:
        return (Engine(name="", url=single_url, capacity=None, queue=None),)
    found = []
    for entry in entries:
        match = _ENTRY.fullmatch(entry.strip())
        if match is None:
            raise ImproperlyConfigured(f"TVCACHE_DOCKER_ENGINES: {entry!r} is not URL=CAPACITY (a positive integer)")
        url = match["url"]
        queue = "engine-" + re.sub(r"[^a-z0-9]+", "-", url.split("://", 1)[-1].lower()).strip("-")
        found.append(Engine(name=url, url=url, capacity=int(match["capacity"]), queue=queue))
    queues = [engine.queue for engine in found]
    if len(set(queues)) != len(queues):
        raise ImproperlyConfigured(f"TVCACHE_DOCKER_ENGINES: two engines would share a Celery queue: {queues}")
    return tuple(found)


def engine_named(name: str) -> Engine | None:
    return next((engine for engine in engines() if engine.name == name), None)


def engine_lost(name: str) -> None:
    """The engine failed: new sandboxes go elsewhere for ENGINE_RETRY_S."""
    if _answering(name):
        log.warning("docker engine %r failed: new sandboxes go elsewhere for %.0f s", name, ENGINE_RETRY_S)
    _lost[name] = time.monotonic() + ENGINE_RETRY_S


def _answering(name: str) -> bool:
    """Whether placements take the engine (it has not failed lately, as this process saw it)."""
    return _lost.get(name, 0.0) <= time.monotonic()


def live_per_engine() -> Counter:
    """Live docker sandboxes (warming to stopping) by engine name."""
    return Counter(
        dict(
            Sandbox.objects.filter(backend="docker")
            .exclude(state__in=(Sandbox.State.STOPPED, Sandbox.State.FAILED))
            .values("engine")
            .annotate(n=Count("id"))
            .values_list("engine", "n")
        )
    )


def engines_placed(count: int, *, exclude: tuple[str, ...] = ()) -> list[Engine]:
    """Engines for `count` new docker sandboxes: each to the engine whose live sandboxes are the
    smallest share of its capacity (ties: the first listed). Engines that failed lately are left
    out unless every one did (the attempt then tells). Empty when `exclude` leaves none."""
    candidates = [engine for engine in engines() if engine.name not in exclude]
    candidates = [engine for engine in candidates if _answering(engine.name)] or candidates
    if len(candidates) <= 1:
        return candidates * count
    live = live_per_engine()
    placed = []
    for _ in range(count):
        engine = min(candidates, key=lambda e: live[e.name] / e.capacity)
        live[engine.name] += 1
        placed.append(engine)
    return placed


def engines_for(backend: str, count: int) -> list[str]:
    """The engines `count` new sandboxes of `backend` go to; "" for the backends that run on this
    host."""
    if backend != "docker":
        return [""] * count
    return [engine.name for engine in engines_placed(count)]


def engine_queue(engine: str) -> str | None:
    """The Celery queue of the workers next to an engine (None: the default queue)."""
    found = engine_named(engine)
    return found.queue if found is not None else None
