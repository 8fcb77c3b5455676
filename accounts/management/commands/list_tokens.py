from django.core.management.base import BaseCommand, CommandError

from accounts.selectors import project_tokens
from accounts.services.projects import project_named


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


class Command(BaseCommand):
    help = "List API tokens (never their keys): project, role, state, created, expires, last used."

    def add_arguments(self, parser):
        parser.add_argument("--project", help="only this project's tokens")

    def handle(self, *args, project: str | None, **options):
        owner = None
        if project is not None:
            owner = project_named(project)
            if owner is None:
                raise CommandError(f"No project '{project}'.")
        rows = project_tokens(project=owner)
        header = ("name", "project", "role", "state", "created", "expires", "last used")
        table = [header] + [
            (
                r["name"],
                r["project"],
                r["role"],
                r["state"],
                _when(r["created_at"]),
                _when(r["expires_at"]),
                _when(r["last_used_at"]),
            )
            for r in rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
