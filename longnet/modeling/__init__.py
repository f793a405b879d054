"""LongNet models: config, causal LM, encoder, pretrained I/O (with the byte-level tokenizer
files), the zoo, Hugging Face import.

Zoo names (``"longnet-tiny"``, ...) resolve to folders of ``models/`` at the repository root
in a source checkout or editable install, to the same folders shipped in the wheel as
``longnet/_zoo`` in an installed package, or to ``$LONGNET_MODELS_DIR``; see
:func:`models_dir` and :func:`list_models`.
"""

from longnet.modeling.config import LongNetConfig
from longnet.modeling.hub import list_models, models_dir, resolve_model_dir
from longnet.modeling.importers import import_hf_checkpoint
from longnet.modeling.model import (
    LongNetEncoder,
    LongNetLM,
    LongNetModel,
    LongNetPreTrained,
    build_block,
)
from longnet.modeling.outputs import EncoderOutput, LMOutput
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
