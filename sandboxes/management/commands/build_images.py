"""`python manage.py build_images [--only busybox|debian] [--force]`: build the docker base images locally."""

from __future__ import annotations

import subprocess

import docker.errors
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from sandboxes.handles import backend_named
from sandboxes.images import BuiltImage, build_busybox_image, build_debian_image


class Command(BaseCommand):
    help = (
        "Build the tvcache base images (tvcache/busybox, tvcache/debian) from Debian packages, on the first "
        "docker engine (the others take its images on first use)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--only", choices=["busybox", "debian"], help="build just this image")
        parser.add_argument("--force", action="store_true", help="rebuild even if the image exists")

    def handle(self, *args: object, only: str | None, force: bool, **options: object) -> None:
        client = backend_named("docker").engine.client
        builders = {
            "busybox": lambda: build_busybox_image(client, force=force),
            "debian": lambda: build_debian_image(client, var_dir=settings.VAR_DIR, force=force),
        }
        for name, build in builders.items():
            if only in (None, name):
                try:
                    self._report(build())
                except (docker.errors.DockerException, subprocess.CalledProcessError) as exc:
                    raise CommandError(f"building the {name} image failed: {exc}") from exc

    def _report(self, image: BuiltImage) -> None:
        if image.built:
            self.stdout.write(self.style.SUCCESS(f"built {image.tag} ({image.image_id[:19]}) in {image.seconds:.1f} s"))
        else:
            self.stdout.write(f"kept {image.tag} ({image.image_id[:19]}); --force rebuilds it")
