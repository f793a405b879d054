"""LongNet models in the Hugging Face tools: ``transformers`` Auto classes, tokenizer, lm-eval.

Importing this package registers model type ``longnet`` with ``transformers``:
``AutoConfig`` gives :class:`LongNetHFConfig` and ``AutoModelForCausalLM`` gives
:class:`LongNetForCausalLM`, a thin adapter over the same ``LongNetLM`` module and weights;
``AutoTokenizer`` on a LongNet folder without tokenizer files says how to write them
(:class:`LongNetTokenizer`).
The folders that ``LongNetLM.save_pretrained`` and the zoo write then load unchanged, with
no ``trust_remote_code``::

    import longnet.hf  # registers the classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("models/longnet-tiny")
    tokenizer = AutoTokenizer.from_pretrained("models/longnet-tiny")

It also registers LongNet's dilated attention for ``transformers``' own models:
``attn_implementation="longnet_dilated"`` with the model config's ``longnet_pattern``
(:mod:`longnet.hf.attention`). ``import_pretrained`` and ``materialize``
(:mod:`longnet.hf.pretrained`) turn a Hugging Face folder or a GGUF file into a LongNet
folder with its tokenizer.

Modules: ``configuration`` (the config), ``modeling`` (the model), ``cache`` (LongNet's
dilated-pattern KV cache for ``generate``), ``padding`` (left padding from attention masks),
``tokenizer`` (the byte tokenizer as a ``transformers`` tokenizer), ``attention`` (dilated
attention for ``transformers``' models), ``pretrained`` (imports), ``harness`` (lm-eval:
imported on its own, it needs the ``eval-harness`` extra). Needs the ``hf`` extra
(``transformers``, ``tokenizers``); the rest of ``longnet`` never imports them.
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
