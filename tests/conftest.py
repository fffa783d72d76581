"""Shared fixtures. The real bundled model is loaded once per session (a few seconds after the
first conversion); tiny random configs are built per test where speed matters."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from laserlm.models.loader import reference_dir

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# measured verify tables (speculative modes on packed weights) go to a file of this run, not the user's cache, so a
# test never reads a table another run (or a damaged file) left; servers started by tests inherit it
os.environ["LASERLM_VERIFY_COSTS"] = os.path.join(tempfile.mkdtemp(prefix="laserlm-test-"), "verify_costs.json")
# LASERLM_TEST_THREADS=1 helps when other jobs share the CPU (2 threads collapse under oversubscription)
torch.set_num_threads(int(os.environ.get("LASERLM_TEST_THREADS", min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def smol():
    """The bundled smollm2-135m as a :class:`laserlm.LaserLM` (float32)."""
    import laserlm

    return laserlm.load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smol_ref(smol):
    """An independent, unmodified transformers copy of smollm2-135m (float32, SDPA attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(reference_dir(smol.loaded), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    on the shared 2-core machine, 2 threads under load from other jobs ran ~10x slower (OpenMP threads wait
    on descheduled peers); results do not depend on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
