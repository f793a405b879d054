"""What a ``torch.compile`` region cannot hold, said in the project's words.

Under ``torch.compile(fullgraph=True)`` Dynamo hides an exception's message and names no cause
for a host read: :func:`refuse` and :func:`host_read` break the graph first with the project's
message."""

from __future__ import annotations

from typing import NoReturn

import torch


def refuse(kind: type[Exception], message: str) -> NoReturn:
    """Raise ``kind(message)``; under ``torch.compile``, break the graph with it first."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=f"{kind.__name__}: {message}")
    raise kind(message)


def host_read(reason: str) -> None:
    """Call before a host read of tensor values: under ``torch.compile``, break with ``reason``."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=reason)
