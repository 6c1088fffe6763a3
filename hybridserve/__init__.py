"""hybridserve: serving linear-attention hybrid LLMs.

    from hybridserve import LLM, SamplingParams
    llm = LLM("builtin")
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=64))[0].text)
"""
from hybridserve.host import spin_policy

spin_policy()  # before torch loads (hybridserve/host.py)

from hybridserve.config import EngineConfig  # noqa: E402
from hybridserve.engine import Engine  # noqa: E402
from hybridserve.llm import LLM  # noqa: E402
from hybridserve.outputs import RequestOutput  # noqa: E402
from hybridserve.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
