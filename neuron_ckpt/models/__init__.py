"""Models built from the parallel layers, and their ``transformers`` checkpoint conversion."""

from .flops import flops_per_token, num_parameters
from .llama import CausalLMOutput, LlamaForCausalLM

__all__ = ["CausalLMOutput", "LlamaForCausalLM", "flops_per_token", "num_parameters"]
