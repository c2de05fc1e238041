import pytest

from pipeline.models import ModelRegistry


@pytest.fixture(scope="session")
def registry() -> ModelRegistry:
    return ModelRegistry()
