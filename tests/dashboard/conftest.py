"""Dashboard fixtures: users, logged-in clients, and a small task whose graph has a few levels."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import Membership
from accounts.projects import DEFAULT_PROJECT, TRAINER
from accounts.services.projects import project_named
from tests.support.graph import PASSWORD, build_tree


@pytest.fixture
def staff_user(db):
    return get_user_model().objects.create_user("alice", password=PASSWORD, is_staff=True, is_superuser=True)


@pytest.fixture
def plain_user(db):
    """A member of the default project with the trainer role: sees its tasks, controls nothing."""
    user = get_user_model().objects.create_user("bob", password=PASSWORD)
    Membership.objects.create(project=project_named(DEFAULT_PROJECT), user=user, role=TRAINER)
    return user


@pytest.fixture
def staff_client(staff_user) -> Client:
    client = Client()
    client.force_login(staff_user)
    return client


@pytest.fixture
def user_client(plain_user) -> Client:
    client = Client()
    client.force_login(plain_user)
    return client


@pytest.fixture
def tree(api, toy_task) -> dict[str, int]:
    return build_tree(api, toy_task)
