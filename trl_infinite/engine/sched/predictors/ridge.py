"""Online ridge regression for the "prefix" length predictor, its penalty chosen by leave-one-group-out error.

Model: `y ~ w . z + b`, with `z` the standardised feature vector (the policy's hidden state at completion token k)
and `y` the log completion length. With `Z` the [n, d] standardised features and `y_c = y - mean(y)`, the thin SVD
`Z = U diag(s) V^T` gives every penalty at once:

    w(lam)   = V diag(s / (s^2 + lam)) U^T y_c          # [d]
    H(lam)   = U diag(s^2 / (s^2 + lam)) U^T            # [n, n] hat matrix, y_hat = H y_c

Samples of the same prompt are strongly correlated (they share the prompt's hidden context), so the penalty is
chosen by the error on *unseen prompts*: for each group S of samples (one prompt), the exact ridge leave-group-out
residual is `e_S = (I - H_SS)^-1 (y_c,S - y_hat_S)` (a |S| x |S| solve). `lam = inf` (predict the mean) is always a
candidate, so on the training data the head is never worse than the constant predictor. The fit keeps the newest
`max_samples` observations (the policy changes during training) and is redone only when the data grew by a quarter.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

PENALTIES = (1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, np.inf)  # multiples of the feature dimension d


class OnlineRidge:
    """`add(x, y, group)` observations, `head(x)` predictions. `l2=None` selects the penalty (see module docs)."""

    def __init__(self, l2: float | None = None, max_samples: int = 1024, refit_growth: float = 1.25):
        self.l2 = l2
        self.max_samples = max_samples
        self.refit_growth = refit_growth
        self.xs: list[np.ndarray] = []
        self.ys: list[float] = []
        self.groups: list[Hashable] = []
        self.w: np.ndarray | None = None
        self._seen = 0  # observations ever added
        self._fitted_on = 0  # observations seen at the last fit

    def add(self, x, y: float, group: Hashable = None) -> None:
        self.xs.append(np.asarray(x, dtype=np.float64).ravel())
        self.ys.append(float(y))
        self.groups.append(len(self.ys) if group is None else group)  # no group: each sample its own
        if len(self.ys) > self.max_samples:
            del self.xs[0], self.ys[0], self.groups[0]
        self._seen += 1

    def fit(self) -> None:
        X = np.stack(self.xs)  # [n, d]
        self.mean, self.std = X.mean(0), X.std(0) + 1e-6
        Z = (X - self.mean) / self.std  # [n, d]
        y = np.asarray(self.ys)
        self.y_mean = float(y.mean())
        yc = y - self.y_mean  # [n]
        U, s, Vt = np.linalg.svd(Z, full_matrices=False)  # [n, r], [r], [r, d]
        Uy = U.T @ yc  # [r]
        d = Z.shape[1]
        lams = [self.l2] if self.l2 is not None else [p * d for p in PENALTIES]
        lam = min(lams, key=lambda lam: self._group_cv_error(U, s, Uy, yc, lam))
        self.w = np.zeros(d) if np.isinf(lam) else Vt.T @ (s / (s**2 + lam) * Uy)
        self._fitted_on = self._seen

    def _group_cv_error(self, U, s, Uy, yc, lam: float) -> float:
        """Mean squared leave-one-group-out residual (log-length units) at penalty `lam`."""
        if np.isinf(lam):
            return float(np.mean(self._group_mean_residuals(yc) ** 2))
        f = s**2 / (s**2 + lam)  # [r] shrinkage factors
        yhat = U @ (f * Uy)  # [n]
        errs = []
        for idx in self._group_indices():
            Us = U[idx]  # [|S|, r]
            H_ss = (Us * f) @ Us.T  # [|S|, |S|]
            errs.append(np.linalg.solve(np.eye(len(idx)) - H_ss, yc[idx] - yhat[idx]))
        return float(np.mean(np.concatenate(errs) ** 2))

    def _group_mean_residuals(self, yc: np.ndarray) -> np.ndarray:
        """Residuals of the mean predictor fitted without each group (the `lam = inf` candidate)."""
        n, total = len(yc), yc.sum()
        out = np.empty(n)
        for idx in self._group_indices():
            rest = n - len(idx)
            out[idx] = yc[idx] - ((total - yc[idx].sum()) / rest if rest else 0.0)
        return out

    def _group_indices(self) -> list[np.ndarray]:
        where: dict[Hashable, list[int]] = {}
        for i, g in enumerate(self.groups):
            where.setdefault(g, []).append(i)
        return [np.asarray(v) for v in where.values()]

    def __call__(self, x) -> float:
        if self.w is None or self._seen >= max(self._fitted_on + 1, self._fitted_on * self.refit_growth):
            self.fit()
        z = (np.asarray(x, dtype=np.float64).ravel() - self.mean) / self.std
        return float(z @ self.w + self.y_mean)

    def __len__(self) -> int:
        return len(self.ys)
