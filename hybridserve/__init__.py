"""hybridserve: serving linear-attention hybrid LLMs.

    from hybridserve import LLM, SamplingParams
    llm = LLM("builtin")
    print(llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=64))[0].text)
"""
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine
from hybridserve.llm import LLM
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
