"""scikit-learn's 8x8 handwritten digits for the examples, in one fixed order; no emberlink, no training."""

from __future__ import annotations

import numpy as np

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""(x_train, y_train, x_test, y_test)."""


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 images (N, 8, 8) as uint8 in 0..16 and their int64 labels, shuffled with seed 1.

    They ship with scikit-learn (no download); without it the example exits saying what to install.
    """
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn: pip install scikit-learn") from None
    data = sk_digits()
    x, y = data.images.astype(np.uint8), data.target.astype(np.int64)
    order = np.random.default_rng(1).permutation(len(x))
    return x[order], y[order]


def split(x: np.ndarray, y: np.ndarray, train_fraction: float = 0.8) -> Split:
    """The first `train_fraction` of the rows to train on, the rest to test on."""
    n = int(train_fraction * len(x))
    return x[:n], y[:n], x[n:], y[n:]
