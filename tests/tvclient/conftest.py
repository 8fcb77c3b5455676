import pytest

from tvclient import TVCacheClient

from .fake_service import FakeService
from .loopback import served


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def client(service: FakeService):
    with served(service.handle) as url, TVCacheClient(url, "secret") as client:
        yield client
