"""Which request field a 400 names as its `param`."""
from hybridserve.protocol import ChatRequest, CompletionRequest
from hybridserve.server import param_of


def test_an_over_long_request_names_max_tokens_the_field_a_client_can_lower():
    msg = ("prompt (5 tokens) + max_tokens (2147483648) exceeds the KV pool's capacity of 4096 tokens: "
           "max_tokens may be at most 4091 for this prompt")
    assert param_of(msg, ChatRequest) == "max_tokens"
    assert param_of(msg, CompletionRequest) == "max_tokens"
    assert param_of("prompt: must not be empty", CompletionRequest) == "prompt"
    assert param_of("nothing named here", CompletionRequest) is None
