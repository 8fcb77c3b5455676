from django.core.management.base import BaseCommand, CommandError

from accounts.services.tokens import TOKEN_CACHE_TTL_S, token_revoke


class Command(BaseCommand):
    help = f"Revoke an API token: every server process refuses it within {TOKEN_CACHE_TTL_S:.0f} seconds."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name: str, **options):
        if not token_revoke(name=name):
            raise CommandError(f"No live token named '{name}'.")
        self.stdout.write(f"Revoked token '{name}'.")
