"""A sequence-classification model as `length_predictor`: the prefix predictor's head is the model's one regression
logit on prompt + prefix ids, run by the engine's `length_regressor` (the scheduling package imports no torch)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from trl_infinite import EngineConfig
from trl_infinite.engine.runner.length_model import length_regressor
from trl_infinite.engine.sched.predictors.base import build_predictor
from trl_infinite.engine.sched.sequence import make_group


def test_a_classification_model_predicts_lengths_through_the_given_function():
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                                       pad_token_id=0)).eval()
    scheduling = EngineConfig(length_predictor=model, prefix_predictor_k=2).scheduling
    pred = build_predictor(scheduling, model_fn=length_regressor)
    seq = make_group(0, [5, 6, 7], 1, 32).samples[0]
    seq.output_ids = [8, 9, 10]
    with torch.no_grad():
        want = float(model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits[0, 0])
    assert pred.predict(seq) == pytest.approx(want)
    with pytest.raises(ValueError, match="length_predictor"):  # no function to run it: refused, not ignored
        build_predictor(scheduling)
