"""LongNet models in the Hugging Face tools (the ``hf`` extra; the rest of ``longnet`` never
imports ``transformers``).

Importing it registers model type ``longnet`` with ``AutoConfig``, ``AutoModelForCausalLM``
and ``AutoTokenizer`` (LongNet folders load with no ``trust_remote_code``) and the attention
implementation ``"longnet_dilated"`` for ``transformers``' own models (``attention``).
``pretrained`` imports Hugging Face folders and GGUF files; ``harness`` (lm-eval, the
``eval-harness`` extra) is imported on its own.
"""

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from longnet.hf import attention
from longnet.hf.attention import use_dilated_attention
from longnet.hf.cache import LongNetCache
from longnet.hf.configuration import LongNetHFConfig
from longnet.hf.modeling import LongNetForCausalLM
from longnet.hf.pretrained import import_pretrained, materialize
from longnet.hf.tokenizer import LongNetTokenizer, byte_tokenizer, load_tokenizer

AutoConfig.register(LongNetHFConfig.model_type, LongNetHFConfig, exist_ok=True)
AutoModelForCausalLM.register(LongNetHFConfig, LongNetForCausalLM, exist_ok=True)
AutoTokenizer.register(LongNetHFConfig, tokenizer_class=LongNetTokenizer, exist_ok=True)
attention.register()

__all__ = [
    "LongNetCache",
    "LongNetForCausalLM",
    "LongNetHFConfig",
    "LongNetTokenizer",
    "byte_tokenizer",
    "import_pretrained",
    "load_tokenizer",
    "materialize",
    "use_dilated_attention",
]
