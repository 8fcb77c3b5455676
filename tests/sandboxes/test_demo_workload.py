"""The README's demo workload (`manage.py demo_workload`, run by .ci/demo.sh) against a live service,
twice: a rerun against the same service goes on with new epochs instead of reusing ended rollouts."""

import io

import pytest
from django.conf import settings
from django.core.management import call_command

from accounts.services.tokens import token_create
from cache.models import Task
from lab.server import service_running
from sandboxes.services import tasks_release

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_demo_workload_runs_and_runs_again(busybox):
    with service_running(
        db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, celery=True, workers=1
    ) as service:
        token = token_create(name="demo")
        try:
            outputs = []
            for _ in range(2):
                out = io.StringIO()
                call_command("demo_workload", url=service.url, token=token, tasks=1, rollouts=2, epochs=1, stdout=out)
                outputs.append(out.getvalue())
        finally:
            tasks_release(task_ids=list(Task.objects.values_list("pk", flat=True)))
    assert outputs[0].startswith("epoch 0: ") and "demo-0" in outputs[0] and "demo-docker" in outputs[0]
    assert outputs[1].startswith("epoch 1: ") and "demo-docker" in outputs[1]
