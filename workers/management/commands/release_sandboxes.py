"""Stop every sandbox of this installation (its database): what the run command does once the
service has stopped, so that no container outlives it. Results and snapshots stay."""

from django.core.management.base import BaseCommand

from sandboxes.services import sandboxes_release


class Command(BaseCommand):
    help = __doc__

    def handle(self, *args, **options):
        released = sandboxes_release()
        self.stdout.write(f"stopped {released['sandboxes']} sandboxes and {released['orphans']} orphans")
