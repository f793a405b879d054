"""A checkpoint's tokenizer record in a compact handoff: a zoo tokenizer's files are left out
and read back from the zoo entry by name (3.4 MB of JSON for SmolLM2's)."""

from __future__ import annotations

from typing import Any

from longnet.data.tokenizer import BYTES, zoo_tokenizer
from longnet.modeling.hub import list_models
from longnet.validation import UsageError


def record_by_name(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without ``files`` its zoo name gives back (same fingerprint), else as is."""
    name = record.get("name")
    if "files" not in record or name not in list_models():
        return record
    try:
        fingerprint = zoo_tokenizer(name).fingerprint
    except (FileNotFoundError, UsageError):  # not readable here: the files stay
        return record
    if fingerprint != record.get("fingerprint"):
        return record
    return {key: value for key, value in record.items() if key != "files"}


def record_with_files(record: dict[str, Any], source: str) -> dict[str, Any]:
    """``record`` with the ``files`` :func:`record_by_name` left out, read back from the zoo
    (``source`` names the record's holder in messages).

    Raises:
        UsageError: the named tokenizer cannot be read here, or has another fingerprint.
    """
    if "files" in record or record.get("name") in (None, BYTES):
        return record
    name, recorded = record["name"], record.get("fingerprint")
    try:
        tokenizer = zoo_tokenizer(name)
    except (FileNotFoundError, UsageError) as err:
        raise UsageError(f"{source} records its tokenizer by the zoo name {name!r} "
                         f"(fingerprint {recorded}), which cannot be read here: {err}") from None
    if tokenizer.fingerprint != recorded:
        raise UsageError(
            f"{source} records the tokenizer {name!r} with fingerprint {recorded}, but {name!r} "
            f"here has fingerprint {tokenizer.fingerprint}; the zoo entry was made with other "
            "versions (transformers writes its tokenizer.json): install the versions the run "
            "trained with."
        )
    return {**record, "files": dict(tokenizer.files)}
