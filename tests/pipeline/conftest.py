import pytest
from sigmaflight.pipeline.models import ModelRegistry


@pytest.fixture(scope="session")
def registry() -> ModelRegistry:
    return ModelRegistry()
