"""`decode/step.py`: what every decode step shares (context rows, the one read-back) and the protocol's steps."""

from __future__ import annotations

import torch

from trl_infinite.engine.decode.static import StaticDecoder
from trl_infinite.engine.decode.step import DecodeStep, EagerStep, ReadBack, one_token, pack, padded_rows
from trl_infinite.engine.spec_decode.decoupled import DecoupledStep
from trl_infinite.engine.spec_decode.step import SpeculativeStep


def test_padded_rows_are_minus_one_padded():
    assert padded_rows([[4, 5, 6], [7], [8, 9]]).tolist() == [[4, 5, 6], [7, -1, -1], [8, 9, -1]]


def test_one_read_back_keeps_token_ids_exact_and_maps_rows():
    """Ids up to a 2**31 vocabulary survive the float64 packing; raw log-probs are the third column; sample i is
    read from row `rows[i]` (the static step's padded, reordered rows)."""
    tokens = torch.tensor([2**31 - 1, 3, 0])
    logprobs = torch.tensor([[-0.5, -0.25], [-1.0, -2.0], [-3.0, -4.0]])
    host = ReadBack(pack(tokens, logprobs)).rows()
    assert host == [[2**31 - 1, -0.5, -0.25], [3, -1.0, -2.0], [0, -3.0, -4.0]]
    out = one_token(host, [2, 0])
    assert out.tokens == [[0], [2**31 - 1]] and out.logprobs == [[-3.0], [-0.5]]
    assert out.raw_logprobs == [[-4.0], [-0.25]] and out.rows == [2, 0]
    assert one_token(ReadBack(pack(tokens, logprobs[:, 0])).rows(), [1]).raw_logprobs is None


def test_every_decode_step_implements_the_protocol():
    for step in (StaticDecoder, EagerStep, SpeculativeStep, DecoupledStep):
        assert issubclass(step, DecodeStep) and step.launch is not DecodeStep.launch
