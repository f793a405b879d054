"""longnet: LongNet dilated-attention transformers for long documents."""

__version__ = "0.1.0"
