import argparse

from django.core.management.base import BaseCommand, CommandError

from accounts.projects import ROLES
from accounts.selectors import project_tokens
from accounts.services.projects import LIMITS, project_set
from core.errors import ApplicationError

NONE = {"none", "null", "unlimited", "-"}
UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _on_off(value: str) -> bool:
    if value.lower() in {"on", "yes", "true", "1"}:
        return True
    if value.lower() in {"off", "no", "false", "0"}:
        return False
    raise CommandError(f"'{value}' is neither on nor off.")


def _number(kind):
    def parse(value: str):
        if value.lower() in NONE:
            return None
        try:
            if kind is int and value[-1:].lower() in UNITS:  # snapshot bytes: 20G
                return int(float(value[:-1]) * UNITS[value[-1].lower()])
            return kind(value)
        except ValueError:
            raise CommandError(
                f"'{value}' is not a {'number' if kind is float else 'whole number'} (or none)."
            ) from None

    return parse


class Command(BaseCommand):
    help = (
        "Create a project or change its operator grants and members. Limits take 'none' to lift the project's "
        "own bound (the service's maxima, TVCACHE_DOCKER_MAX_*, always apply)."
    )

    def add_arguments(self, parser):
        parser.add_argument("project")
        parser.add_argument("--network", metavar="on|off", help="docker network access (the service must allow it too)")
        parser.add_argument(
            "--images", metavar="IMAGE,...", help="images its tasks may name; '' for every image the service runs"
        )
        parser.add_argument("--max-memory-mb", type=_number(int), default=argparse.SUPPRESS)
        parser.add_argument("--max-cpus", type=_number(float), default=argparse.SUPPRESS)
        parser.add_argument("--max-pids", type=_number(int), default=argparse.SUPPRESS)
        parser.add_argument("--max-live-sandboxes", type=_number(int), default=argparse.SUPPRESS)
        parser.add_argument("--max-snapshot-bytes", type=_number(int), default=argparse.SUPPRESS, help="e.g. 20G")
        parser.add_argument(
            "--rate-limit", type=_number(int), default=argparse.SUPPRESS, metavar="PER_S", help="requests per second"
        )
        parser.add_argument(
            "--rate-burst",
            type=_number(int),
            default=argparse.SUPPRESS,
            metavar="N",
            help="default: one second's worth",
        )
        parser.add_argument(
            "--task-max-nodes",
            type=_number(int),
            default=argparse.SUPPRESS,
            metavar="N",
            help="retention: nodes each task keeps at most unless it sets its own",
        )
        parser.add_argument(
            "--task-max-result-bytes",
            type=_number(int),
            default=argparse.SUPPRESS,
            metavar="BYTES",
            help="retention: result bytes each task keeps at most unless it sets its own, e.g. 2G",
        )
        parser.add_argument(
            "--member",
            action="append",
            default=[],
            metavar="USER[:ROLE]",
            help=f"add or change a dashboard member (role: {'|'.join(ROLES)}, default trainer)",
        )
        parser.add_argument("--remove-member", action="append", default=[], metavar="USER")

    def handle(self, *args, project: str, network, images, member, remove_member, **options):
        grants = {field: options[field] for field in LIMITS if field in options}  # left out: unchanged; "none": lifted
        if network is not None:
            grants["network"] = _on_off(network)
        if images is not None:
            grants["images"] = [image.strip() for image in images.split(",") if image.strip()]
        members = {}
        for entry in member:
            username, _, role = entry.partition(":")
            members[username] = role or "trainer"
        members.update({username: None for username in remove_member})
        try:
            changed = project_set(name=project, grants=grants, members=members)
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        fields = ("network", "images", *LIMITS)
        self.stdout.write(f"project {changed.name}: " + ", ".join(f"{f}={getattr(changed, f)}" for f in fields))
        members_now = changed.memberships.select_related("user").order_by("user__username")
        self.stdout.write("members: " + (", ".join(f"{m.user.get_username()} ({m.role})" for m in members_now) or "-"))
        self.stdout.write(f"tokens: {len(project_tokens(project=changed))}")
