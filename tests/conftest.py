import pytest
import torch

from tests.utils import import_torch_reference

torch.set_num_threads(1)  # small tensors; more threads only contend on a shared 2-core machine

# Bind transformers' reference models to their torch paths before anything imports FLA.
for _m in ("kimi_linear", "qwen3_next", "nemotron_h"):
    import_torch_reference(f"transformers.models.{_m}.modeling_{_m}")


@pytest.fixture(scope="session", autouse=True)
def engines_skip_warm_up():
    """Engines start without their warm-up forward (EngineConfig.warmup: one forward as large as
    the largest round), which would add seconds to each of the suite's many engine starts; tests
    marked `warmup` get it back (warm_up_where_marked)."""
    from hybridserve.engine import Engine

    with pytest.MonkeyPatch.context() as mp:
        real = Engine.warm_up
        mp.setattr(Engine, "warm_up", lambda self: None)
        yield real


@pytest.fixture(autouse=True)
def warm_up_where_marked(request, engines_skip_warm_up, monkeypatch):
    if request.node.get_closest_marker("warmup"):
        from hybridserve.engine import Engine

        monkeypatch.setattr(Engine, "warm_up", engines_skip_warm_up)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
