"""What a ``torch.compile`` region cannot hold, said in the project's words.

Under ``torch.compile(fullgraph=True)`` an exception raised while Dynamo traces a call becomes
Dynamo's "Observed exception" error, with the message only in a debug line, and a read of
tensor values on the host a "data-dependent expression" error that names neither the cause
nor the fix. :func:`refuse` and :func:`host_read` break the graph first with the project's
message, which Dynamo then shows as the reason ("User-inserted graph break. Message: ...").
Without ``fullgraph`` the call goes on in eager mode, where the same exception is raised (or
the read runs), as without compiling; outside ``torch.compile`` both cost one flag test.
"""

from __future__ import annotations

from typing import NoReturn

import torch


def refuse(kind: type[Exception], message: str) -> NoReturn:
    """Raise ``kind(message)``; under ``torch.compile``, break the graph with the message
    first."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=f"{kind.__name__}: {message}")
    raise kind(message)


def host_read(reason: str) -> None:
    """Call before reading tensor values on the host: under ``torch.compile``, break the graph
    with ``reason`` (why the region cannot hold the read, and what to do instead)."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(msg=reason)
