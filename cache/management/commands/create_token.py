from django.core.management.base import BaseCommand, CommandError

from cache.api.auth import token_create
from cache.models import ApiToken


class Command(BaseCommand):
    help = "Create an API token for a trainer and print it (only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("name")

    def handle(self, *args, name: str, **options):
        if ApiToken.objects.filter(name=name).exists():
            raise CommandError(f"A token named '{name}' exists already.")
        self.stdout.write(token_create(name=name))
