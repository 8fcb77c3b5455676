"""The one launcher of the served service (benchmarks, the replay, browser tests)."""

import os

import environ
import httpx
import pytest
from django.conf import settings

from lab.server import database_url, service_running

pytestmark = pytest.mark.django_db(transaction=True)


def test_without_redis_the_service_comes_up_with_no_worker():
    # Embedded default: background work runs in the service's own processes.
    with service_running(db=settings.DATABASES["default"], redis_url="", celery=True, workers=1) as service:
        assert service.queue is None
        assert httpx.get(service.url + "/api/schema/", timeout=10).status_code == 200


def test_a_worker_on_its_own_queue_answers_before_the_service_is_handed_over():
    with service_running(
        db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, celery=True, workers=1
    ) as service:
        assert service.queue and service.queue.startswith("tvcache-")


def test_without_a_worker_the_jobs_still_go_to_a_queue_of_its_own():
    # Never the default queue, where a worker of another deployment (another database) takes them.
    with service_running(db=settings.DATABASES["default"], redis_url=settings.REDIS_URL, workers=1) as service:
        assert service.queue and service.queue.startswith("tvcache-")


def test_restart_kills_the_web_server_and_serves_again_on_the_same_address():
    # The replays' fault arm: a crash (SIGKILL to the whole process tree) and a new server.
    with service_running(db=settings.DATABASES["default"], redis_url="", workers=2) as service:
        url, first = service.url, service.pid
        service.restart()
        assert service.url == url and service.pid != first
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert httpx.get(url + "/api/schema/", timeout=10).status_code == 200


def test_database_url_round_trips_credentials_with_reserved_characters():
    db = {"USER": "u@x", "PASSWORD": "p:/#w?", "HOST": "db", "PORT": 5433, "NAME": "tv"}
    parsed = environ.Env.db_url_config(database_url(db))
    assert {key: parsed[key] for key in db} == db
