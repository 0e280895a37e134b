"""One MLP training step through emberlink on Device.cpu() against the same math in NumPy by hand.

The model: batch 128, 784-512-512-10, ReLU, float32, softmax cross-entropy (mean), SGD lr=0.01.
Both sides start from the same weights, see the same batches, run in this process on the same
NumPy and BLAS, and their losses are checked to agree. The emberlink time includes everything a
user pays: copying the batch in, recording forward, backward and update, the flush (memoized
graph lookup), the plan run and reading the loss. Goal: at most 1.25x the hand-written step.

The jit row runs the same step compiled with `emberlink.jit` (traced once, then replayed: no
recording, no segment, one plan run per step), fed the same batches; its losses must equal the
eager emberlink losses exactly. Goal: at most 1.05x the hand-written step.

    .venv/bin/python bench/local_step.py [--steps 300] [--quick] [--profile [eager|jit]]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np

import emberlink as el

BATCH, SIZES, LR = 128, (784, 512, 512, 10), 0.01


class NumpyMLP:
    """The same model with forward, backward and the SGD update written out by hand."""

    def __init__(self, params: list[np.ndarray]) -> None:
        self.params = [p.copy() for p in params]  # W1, b1, W2, b2, W3, b3; W is (in, out)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        w1, b1, w2, b2, w3, b3 = self.params
        n = x.shape[0]
        h1p = x @ w1 + b1
        h1 = np.maximum(h1p, np.float32(0))
        h2p = h1 @ w2 + b2
        h2 = np.maximum(h2p, np.float32(0))
        z = h2 @ w3 + b3
        shifted = z - z.max(axis=1, keepdims=True)
        e = np.exp(shifted)
        s = e.sum(axis=1, keepdims=True)
        logp = shifted - np.log(s)
        loss = -logp[np.arange(n), y].sum() / np.float32(n)
        dz = e / s
        dz[np.arange(n), y] -= np.float32(1)
        dz /= np.float32(n)
        dw3, db3, dh2 = h2.T @ dz, dz.sum(axis=0), dz @ w3.T
        dh2 = dh2 * (h2p > 0)
        dw2, db2, dh1 = h1.T @ dh2, dh2.sum(axis=0), dh2 @ w2.T
        dh1 = dh1 * (h1p > 0)
        dw1, db1 = x.T @ dh1, dh1.sum(axis=0)
        lr = np.float32(LR)
        grads = (dw1, db1, dw2, db2, dw3, db3)
        self.params = [p - g * lr for p, g in zip(self.params, grads, strict=True)]
        return float(loss)


class EmberlinkMLP:
    """The model as a user writes it with emberlink."""

    def __init__(self, dev: el.Device, seed: int = 0) -> None:
        nn = el.nn
        self.dev = dev
        self.model = nn.Sequential(
            nn.Linear(SIZES[0], SIZES[1], seed=seed),
            nn.ReLU(),
            nn.Linear(SIZES[1], SIZES[2], seed=seed + 1),
            nn.ReLU(),
            nn.Linear(SIZES[2], SIZES[3], seed=seed + 2),
        ).to(dev)
        self.opt = el.optim.SGD(self.model.parameters(), lr=LR)

    def params(self) -> list[np.ndarray]:
        return [p.numpy() for p in self.model.parameters()]

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        dev = self.dev
        loss = el.nn.functional.cross_entropy(self.model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)


class JitMLP(EmberlinkMLP):
    """The same model, its step compiled with `emberlink.jit` (the batch goes in as tensors)."""

    def __init__(self, dev: el.Device, seed: int = 0) -> None:
        super().__init__(dev, seed)

        @el.jit
        def train(x: el.Tensor, y: el.Tensor) -> el.Tensor:
            loss = el.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return loss

        self.train = train

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        dev = self.dev
        return float(self.train(dev.tensor(x), dev.tensor(y)))


def _batches(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [
        (rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32), rng.integers(0, SIZES[-1], BATCH))
        for _ in range(count)
    ]


def _time(
    step: Callable[[np.ndarray, np.ndarray], float],
    batches: list[tuple[np.ndarray, np.ndarray]],
    n: int,
    out: list[float],
) -> None:
    for i in range(n):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        step(x, y)
        out.append(time.perf_counter() - t0)


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl missing)"
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return ", ".join(f"{p['internal_api']} {p['version']} with {p['num_threads']} threads" for p in pools)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per side")
    parser.add_argument("--quick", action="store_true", help="60 steps a side")
    parser.add_argument(
        "--profile", nargs="?", const="eager", choices=("eager", "jit"), help="cProfile one emberlink side"
    )
    parser.add_argument("--blas-threads", type=int, default=0, help="limit BLAS threads (0: its default)")
    args = parser.parse_args()
    if args.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads)

    if args.quick:
        args.steps = 60
    batches = _batches(8)
    dev = el.Device.cpu()
    ours = EmberlinkMLP(dev)
    jitted = JitMLP(dev)
    hand = NumpyMLP(ours.params())

    # Same start, same batches: the sides must compute the same losses (float32 rounding aside
    # against NumPy; exactly between eager and jit, which run the same graph).
    check = [(ours.step(x, y), hand.step(x, y), jitted.step(x, y)) for x, y in batches[:5]]
    worst = max(abs(a - b) for a, b, _ in check)
    if worst > 1e-4:
        raise SystemExit(f"emberlink and NumPy disagree: losses {check}")
    if any(a != c for a, _, c in check):
        raise SystemExit(f"eager and jit disagree: losses {check}")

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        _time((ours if args.profile == "eager" else jitted).step, batches, args.steps, [])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return

    t_hand: list[float] = []
    t_ours: list[float] = []
    t_jit: list[float] = []
    block = 10  # sides alternate every few steps: warm caches, yet load on the machine hits both
    for _ in range(max(1, args.steps // block)):
        _time(hand.step, batches, block, t_hand)
        _time(ours.step, batches, block, t_ours)
        _time(jitted.step, batches, block, t_jit)
    pair = statistics.median(o / h for o, h in zip(t_ours, t_hand, strict=True))
    pair_jit = statistics.median(o / h for o, h in zip(t_jit, t_hand, strict=True))

    def row(name: str, ts: list[float]) -> str:
        q = statistics.quantiles(ts, n=10)
        return f"{name:<28}{statistics.median(ts) * 1e3:>10.3f}{q[0] * 1e3:>10.3f}{q[-1] * 1e3:>10.3f}"

    ratio = statistics.median(t_ours) / statistics.median(t_hand)
    ratio_jit = statistics.median(t_jit) / statistics.median(t_hand)
    stats = dev.stats()
    print(
        f"MLP training step: batch {BATCH}, {'-'.join(map(str, SIZES))}, float32, "
        f"cross-entropy, SGD lr={LR}; {len(t_ours)} steps a side"
    )
    print(f"same process, NumPy {np.__version__}, BLAS: {_blas()}")
    print(f"{'':<28}{'median ms':>10}{'p10 ms':>10}{'p90 ms':>10}")
    print(row("NumPy by hand", t_hand))
    print(row("emberlink Device.cpu()", t_ours))
    print(row("emberlink Device.cpu() jit", t_jit))
    print(
        f"{'ratio (emberlink / NumPy)':<28}{ratio:>10.3f}   goal <= 1.25 (median of paired steps: {pair:.3f})"
    )
    print(
        f"{'ratio (jit / NumPy)':<28}{ratio_jit:>10.3f}   goal <= 1.05 (median of paired steps: {pair_jit:.3f})"
    )
    print(
        f"losses agree within {worst:.1e} (jit = eager exactly); graphs built {stats['graphs_built']}, "
        f"memo hits {stats['graph_memo_hits']}, plan replays {stats['graph_replays']}, "
        f"jit replays {stats['jit_replays']}"
    )
    dev.close()


if __name__ == "__main__":
    main()
