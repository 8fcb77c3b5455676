import httpx
import pytest

from tvclient import TVCacheClient

from .fake_service import FakeService


@pytest.fixture
def service() -> FakeService:
    return FakeService()


@pytest.fixture
def client(service: FakeService):
    with TVCacheClient(
        "http://tvcache.test", "secret", transport=httpx.MockTransport(service.handle)
    ) as client:
        yield client
