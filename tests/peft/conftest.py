import pytest
from peft_support import tiny_model


@pytest.fixture
def llama():
    return tiny_model("llama")
