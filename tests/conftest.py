import pytest

from tests.tiny import save_tiny, tiny_llama


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0)
