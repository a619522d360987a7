"""The prefix predictor's ridge head: penalty chosen by leave-one-group-out error, never worse than the mean."""

import numpy as np

from trl_infinite.engine.sched.predictors.ridge import OnlineRidge


def _data(informative: bool, groups: int = 8, per_group: int = 16, d: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs, ys, gs = [], [], []
    for g in range(groups):
        center = rng.normal(size=d)  # samples of one prompt share most of their hidden state
        for _ in range(per_group):
            x = center + 0.3 * rng.normal(size=d)
            y = 5.0 + (0.5 * x[0] if informative else 0.0) + 0.1 * rng.normal()
            xs.append(x), ys.append(y), gs.append(g)
    return xs, ys, gs


def _holdout_mae(head_factory, informative: bool) -> tuple[float, float]:
    """(head MAE, constant-mean MAE) on fresh prompts."""
    xs, ys, gs = _data(informative)
    head = head_factory()
    for x, y, g in zip(xs, ys, gs):
        head.add(x, y, group=g)
    tx, ty, _ = _data(informative, groups=4, seed=1)
    pred = np.array([head(x) for x in tx])
    return float(np.mean(np.abs(pred - ty))), float(np.mean(np.abs(np.mean(ys) - np.array(ty))))


def test_uninformative_features_fall_back_to_the_mean():
    head_mae, mean_mae = _holdout_mae(OnlineRidge, informative=False)
    assert head_mae <= mean_mae * 1.05  # a fixed small penalty would overfit the 8 prompts' centers
    overfit_mae, _ = _holdout_mae(lambda: OnlineRidge(l2=1e-3), informative=False)
    assert overfit_mae > head_mae


def test_informative_features_are_used():
    head_mae, mean_mae = _holdout_mae(OnlineRidge, informative=True)
    assert head_mae < 0.5 * mean_mae


def test_refits_only_when_the_data_grew():
    xs, ys, gs = _data(True)
    head = OnlineRidge(max_samples=64)
    for x, y, g in zip(xs[:40], ys[:40], gs[:40]):
        head.add(x, y, group=g)
    head(xs[0])
    w = head.w
    head.add(xs[40], ys[40], group=gs[40])
    head(xs[0])
    assert head.w is w  # 41 < 1.25 * 40: no refit
    for x, y, g in zip(xs[41:], ys[41:], gs[41:]):
        head.add(x, y, group=g)
    head(xs[0])
    assert head.w is not w and len(head) == 64  # refitted on the newest 64
