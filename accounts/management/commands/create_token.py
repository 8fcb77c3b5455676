import datetime as dt

from django.core.management.base import BaseCommand, CommandError

from accounts.models import ApiToken
from accounts.projects import DEFAULT_PROJECT, ROLES, TRAINER
from accounts.services.tokens import token_create
from core.errors import InvalidInput


class Command(BaseCommand):
    help = (
        "Create an API token of a project (made if it does not exist) with a role, and print it: only its "
        "hash is stored. A trainer looks up, records, runs tool-server calls, registers snapshots, creates "
        "tasks and announces steps; a maintainer may also change a task's env, tools or budget, flush, "
        "evict and pin (audited)."
    )

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--project", default=DEFAULT_PROJECT, help=f"default: {DEFAULT_PROJECT}")
        parser.add_argument("--role", choices=ROLES, default=TRAINER, help=f"default: {TRAINER}")
        parser.add_argument(
            "--expires", type=float, metavar="DAYS", help="expire after this many days (default: never)"
        )
        parser.add_argument("--replace", action="store_true", help="delete the token of that name first, if any")

    def handle(self, *args, name: str, project: str, role: str, expires: float | None, replace: bool, **options):
        if replace:
            ApiToken.objects.filter(name=name).delete()
        if ApiToken.objects.filter(name=name).exists():
            raise CommandError(f"A token named '{name}' exists already.")
        if expires is not None and not expires > 0:
            raise CommandError("--expires must be a positive number of days.")
        try:
            key = token_create(
                name=name,
                project=project,
                role=role,
                expires_in=dt.timedelta(days=expires) if expires is not None else None,
            )
        except InvalidInput as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(key)
