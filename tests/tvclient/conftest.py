import pytest

from tvclient import RetryPolicy, TVCacheClient

from .fake_service import FakeService
from .loopback import served


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def client(service: FakeService):
    # A scripted answer the test did not script is a 500, which clients retry: briefly here.
    with served(service.handle) as url, TVCacheClient(url, "secret", retry=RetryPolicy(budget_s=0.2)) as client:
        yield client
