"""The images the docker backend runs and makes: image names, snapshot images (commits of a
sandbox, tagged tvcache/snapshot:<hex>, with a checkpoint of the same name where the sandbox's
runtime keeps processes: checkpoint.py), the labels that tell our containers and images from
whatever else shares the engine, and the base layers under a sandbox's snapshots."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any

import docker
import docker.errors

from ..base import OWNER, OWNER_LABEL, OwnedResource

SHELL_LABEL = "tvcache.shell"
KIND_LABEL = "tvcache.kind"
# On checkpoint snapshots (checkpoint.py): the checkpoint's name in the store, and the runtime that
# took it (a fork runs under the same one).
CHECKPOINT_LABEL = "tvcache.checkpoint"
RUNTIME_LABEL = "tvcache.runtime"
SNAPSHOT_REPOSITORY = "tvcache/snapshot"
SNAPSHOT_REF = re.compile(re.escape(SNAPSHOT_REPOSITORY) + r":[0-9a-f]{32}")


def image_name(image: str) -> str:
    """`name` and `name:latest` are one image; a digest or a tag is kept as given."""
    if "@" in image or ":" in image.rsplit("/", 1)[-1]:
        return image
    return f"{image}:latest"


def is_snapshot(image: Mapping[str, Any]) -> bool:
    return (image["Config"].get("Labels") or {}).get(KIND_LABEL) == "snapshot"


def checkpoint_of(image: Mapping[str, Any]) -> tuple[str, str] | None:
    """(checkpoint name, runtime) of a checkpoint snapshot's image; None for any other image."""
    labels = image["Config"].get("Labels") or {}
    if not is_snapshot(image) or not labels.get(CHECKPOINT_LABEL):
        return None
    return labels[CHECKPOINT_LABEL], labels.get(RUNTIME_LABEL, "")


def container_labels(image: dict[str, Any], labels: Mapping[str, str]) -> dict[str, str]:
    # Containers inherit their image's labels and docker cannot remove one, so labels a snapshot
    # carried from its source sandbox are blanked: a fork carries exactly the labels it was given.
    inherited = image["Config"].get("Labels") or {}
    blanked = {key: "" for key in inherited if key not in (OWNER_LABEL, SHELL_LABEL)}
    return {**blanked, **labels, OWNER_LABEL: OWNER, KIND_LABEL: "sandbox"}


def label_filter(kind: str, selector: Mapping[str, str] | None) -> list[str]:
    return [f"{OWNER_LABEL}={OWNER}", f"{KIND_LABEL}={kind}", *(f"{k}={v}" for k, v in (selector or {}).items())]


def owned(resource_id: str, labels: Mapping[str, str] | None, created: int | None) -> OwnedResource:
    created_at = dt.datetime.fromtimestamp(created, dt.UTC) if created else None
    return OwnedResource(id=resource_id, labels={k: v for k, v in (labels or {}).items() if v}, created_at=created_at)


def drop_if_deleted_snapshot(api: docker.APIClient, image_id: str) -> None:
    """A deleted snapshot stays as an untagged image while forks run from it; the last one drops it."""
    try:
        image = api.inspect_image(image_id)
        if is_snapshot(image) and not image.get("RepoTags"):
            api.remove_image(image_id)
    except docker.errors.APIError:  # gone already, or still used by another fork
        pass


class BaseLayers:
    """The layer folders of the base image under an image (below its snapshots' layers), by image
    id: images never change."""

    def __init__(self):
        self._found: dict[str, frozenset[str]] = {}

    def of(self, api: docker.APIClient, image_id: str) -> frozenset[str]:
        found = self._found.get(image_id)
        if found is None:
            image = api.inspect_image(image_id)
            while is_snapshot(image) and image.get("Parent"):
                image = api.inspect_image(image["Parent"])
            data = (image.get("GraphDriver") or {}).get("Data") or {}
            found = frozenset(d for d in [data.get("UpperDir"), *(data.get("LowerDir") or "").split(":")] if d)
            self._found[image_id] = found
        return found
