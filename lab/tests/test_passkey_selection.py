"""``lab.scripts.passkey_selection`` on a tiny byte model with retrieval branches: one line per
layer for the answering query, ranks that agree with the choice, and clear refusals."""

from __future__ import annotations

import re

import pytest

from lab.scripts import passkey_selection

TINY = ['--model', 'longnet-tiny', '--overrides',
        '{"pattern": [[256, 1]], "attention_sinks": 4, "select_top_k": 4, "select_block": 16}',
        '--length', '2048', '--depth', '0.25']


def test_one_line_per_layer_and_a_chosen_block_ranks_within_top_k(capsys, one_thread):
    assert passkey_selection.main(TINY) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("query 2042 layer")]
    assert len(lines) == 4  # longnet-tiny's layers, the answering query seen once each
    for line in lines:
        ranks = [int(r) for r in re.search(r"rank per K/V head \[([^]]*)\]", line)[1].split(",")]
        chosen = re.search(r"chosen \[([^]]*)\]", line)[1].split(", ")
        # the needle's block is chosen when its rank is within the top 4 (or the next block is)
        assert all(c == "True" for r, c in zip(ranks, chosen) if r < 4)
    assert "answering query at 2042" in out and "generated" in out


def test_refuses_an_example_beyond_the_draw_and_a_model_without_selection(one_thread):
    with pytest.raises(ValueError, match="--example 1 is not below --num-examples 1"):
        passkey_selection.main([*TINY, "--example", "1"])
    with pytest.raises(ValueError, match="has no block selection"):
        passkey_selection.main(["--model", "longnet-tiny", "--length", "2048", "--depth", "0.5"])
