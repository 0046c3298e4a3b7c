import pytest

from tests.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")
