import pytest
import torch

from tests.utils import import_torch_reference

torch.set_num_threads(1)  # small tensors; more threads only contend on a shared 2-core machine

# Bind transformers' reference models to their torch paths before anything imports FLA.
for _m in ("kimi_linear", "qwen3_next", "nemotron_h"):
    import_torch_reference(f"transformers.models.{_m}.modeling_{_m}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
