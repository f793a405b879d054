"""Data for longnet: byte tokenization, long-document corpora and generated long-range tasks.

Every dataset is map-style; samples are ``{"input_ids": (seq_len,), "labels": (seq_len,)}``
int64, labels already shifted (``-100`` where no loss is taken). Recipes: ``data/README.md``.
"""

from longnet.constants import IGNORE_INDEX
from longnet.data.corpus import CorpusSettings, LongDocumentSplits, build_long_document_splits
from longnet.data.datamodules import LongDocumentDataModule, MQARDataModule, PasskeyDataModule
from longnet.data.reading import DocumentSource
from longnet.data.repositories import Package, PackageSource, repository_source
from longnet.data.sources import corpus_source, files_source, package_source, stdlib_source
from longnet.data.synthetic import (
    MQARDataset,
    MQARExample,
    PasskeyDataset,
    PasskeyExample,
    make_mqar_example,
    make_passkey_example,
    passkey_examples,
    passkey_match,
    sample_rng,
)
from longnet.data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "EOS_ID",
    "IGNORE_INDEX",
    "PAD_ID",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "CorpusSettings",
    "DocumentSource",
    "LongDocumentDataModule",
    "LongDocumentSplits",
    "MQARDataModule",
    "MQARDataset",
    "MQARExample",
    "Package",
    "PackageSource",
    "PasskeyDataModule",
    "PasskeyDataset",
    "PasskeyExample",
    "build_long_document_splits",
    "corpus_source",
    "files_source",
    "make_mqar_example",
    "make_passkey_example",
    "package_source",
    "passkey_examples",
    "passkey_match",
    "repository_source",
    "sample_rng",
    "stdlib_source",
]
