"""LongNet models: config, causal LM, encoder, pretrained I/O, the zoo, Hugging Face import."""

from longnet.modeling.config import LongNetConfig
from longnet.modeling.encoder import EncoderOutput, LongNetEncoder
from longnet.modeling.hub import list_models, models_dir, resolve_model_dir
from longnet.modeling.importers import import_hf_checkpoint
from longnet.modeling.model import LMOutput, LongNetLM, LongNetModel, LongNetPreTrained, build_block
from longnet.modeling.pretrained import count_parameters, model_card
from longnet.modeling.serialization import NonFiniteWeightsError, WeightsMismatchError
from longnet.modeling.tokenizer_files import write_tokenizer_files

__all__ = [
    "EncoderOutput",
    "LMOutput",
    "LongNetConfig",
    "LongNetEncoder",
    "LongNetLM",
    "LongNetModel",
    "LongNetPreTrained",
    "NonFiniteWeightsError",
    "WeightsMismatchError",
    "build_block",
    "count_parameters",
    "import_hf_checkpoint",
    "list_models",
    "model_card",
    "models_dir",
    "resolve_model_dir",
    "write_tokenizer_files",
]
