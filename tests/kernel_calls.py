"""Counting the block-kernel calls of ``dilated_attention`` (for tests of the plan)."""

from __future__ import annotations

from dataclasses import replace

from longnet.attention import kernels


def count_kernel_calls(monkeypatch) -> list[str]:
    """Wrap every registered kernel so that each forward and backward call appends its
    function's name to the returned list (undone by ``monkeypatch``)."""
    calls: list[str] = []

    def counted(function):
        def wrapper(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kernels, "KERNELS", tuple(
        replace(k, forward=counted(k.forward), backward=counted(k.backward))
        for k in kernels.KERNELS
    ))
    return calls
