"""What accounts asks of the apps above it without importing them: accounts sits below them all,
so they register their answers when Django starts and accounts calls through them. Asking before
they are registered is a programming error, never a default: a request left uncounted, or a
project granted an image the service does not run, would go unnoticed.

- The images the service runs (a project's images are chosen among them): the sandboxes app
  (`SandboxesConfig.ready`).
- Counting an API request of a project, admitted or refused by its rate limit: the cache app
  (`CacheConfig.ready`), whose ledger writes the counts (`ProjectRequests`) with its own.
"""

from __future__ import annotations

from collections.abc import Callable

_images: Callable[[], list[str]] | None = None
_request_counter: Callable[..., None] | None = None


def images_register(images: Callable[[], list[str]]) -> None:
    global _images
    _images = images


def request_counter_register(counter: Callable[..., None]) -> None:
    """`counter(project_id=..., admitted=...)`: never blocks (the hot path calls it)."""
    global _request_counter
    _request_counter = counter


def service_images() -> list[str]:
    """The images the service runs, sorted."""
    if _images is None:
        raise RuntimeError("No images: the sandboxes app registers them at start (INSTALLED_APPS).")
    return _images()


def request_count(*, project_id: int, admitted: bool) -> None:
    """One API request of the project, admitted or refused by its rate limit."""
    if _request_counter is None:
        raise RuntimeError("No request counter: the cache app registers it at start (INSTALLED_APPS).")
    _request_counter(project_id=project_id, admitted=admitted)
