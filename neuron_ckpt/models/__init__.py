"""Models built from the parallel layers, and their ``transformers`` checkpoint conversion."""

from .config_file import load_llama_config
from .hf_checkpoint import check_hf_config, hf_config_for, load_hf_checkpoint, read_hf_config
from .hf_export import check_writable, save_hf_checkpoint
from .llama import CausalLMOutput, LlamaForCausalLM
from .llama_args import LlamaArgs

__all__ = [
    "CausalLMOutput",
    "LlamaArgs",
    "LlamaForCausalLM",
    "check_hf_config",
    "check_writable",
    "hf_config_for",
    "load_hf_checkpoint",
    "load_llama_config",
    "read_hf_config",
    "save_hf_checkpoint",
]
