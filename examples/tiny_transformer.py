"""Train a tiny character-level transformer language model with emberlink, here or on a remote GPU.

    python examples/tiny_transformer.py                          # this machine's CPU
    python examples/tiny_transformer.py --device cuda:0          # this machine's GPU (needs CuPy)
    python examples/tiny_transformer.py --device 'emberlink://<node-id>@gpu-box:7443'   # a worker

The text ships with an installed package, so nothing is downloaded: scikit-learn's descriptions of
its data sets (`sklearn/datasets/descr/*.rst`, about 43 KB), or numpy's license when scikit-learn
is missing. The model: token and position embeddings, pre-LN TransformerEncoderLayers with a
causal mask, a LayerNorm and a Linear head. The text stays on the device; a step uploads only the
start of each window (a few hundred bytes), and `float(loss)` is its one read.

It prints the unigram baseline (the entropy of the character frequencies: the best loss of a model
that ignores the context), the training loss falling below it, a held-out loss, and a sample.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
from collections.abc import Sequence

import numpy as np

import emberlink as el
from emberlink import nn

F = nn.functional


def open_device(spec: str) -> el.Device:
    """`cpu`, `cuda` or `cuda:N`, or a worker's ticket / a `nats://` relay address."""
    if spec == "cpu":
        return el.Device.cpu()
    if spec.startswith("cuda"):
        return el.Device.cuda(int(spec.partition(":")[2] or 0))
    return el.Device.remote(spec)


def load_text() -> tuple[str, str]:
    """(name, text) of a few tens of KB of English that an installed package ships (read from the
    installed files, without importing the package)."""
    try:
        files = importlib.metadata.distribution("scikit-learn").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    parts = sorted((f for f in files if f.match("sklearn/datasets/descr/*.rst")), key=str)
    if parts:
        return "scikit-learn's data set descriptions", "\n".join(f.read_text(encoding="utf-8") for f in parts)
    licenses = [
        f for f in importlib.metadata.distribution("numpy").files or [] if f.name.startswith("LICENSE")
    ]
    path = max(licenses, key=lambda f: len(f.read_text(encoding="utf-8")))
    return "numpy's license", path.read_text(encoding="utf-8")


class CharLM(nn.Module):
    """Embeddings, `layers` causal TransformerEncoderLayers (pre-LN), a final LayerNorm, a head."""

    def __init__(
        self, vocab: int, context: int, d_model: int, nhead: int, layers: int, dropout: float
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, seed=0)
        self.pos = nn.Embedding(context, d_model, seed=1)
        for emb in (self.tok, self.pos):  # N(0, 0.02), as GPT-2 starts them: N(0, 1) trains slower
            emb.weight.assign(emb.weight.numpy() * 0.02)
        self.blocks = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    d_model,
                    nhead,
                    4 * d_model,
                    dropout,
                    "gelu",
                    batch_first=True,
                    norm_first=True,
                    seed=2 + i,
                )
                for i in range(layers)
            )
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, seed=99)

    def forward(self, idx: el.Tensor) -> el.Tensor:
        """Logits (B, T, vocab) for token ids `idx` (B, T); position t sees tokens 0..t only."""
        x = self.tok(idx) + self.pos(idx.device.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, is_causal=True)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def train(dev: el.Device, args: argparse.Namespace) -> None:
    name, text = load_text()
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = np.array([lookup[c] for c in text], dtype="int64")
    split = int(0.9 * len(data))
    counts = np.bincount(data[:split], minlength=len(chars))
    freq = counts[counts > 0] / split
    baseline = float(-(freq * np.log(freq)).sum())
    print(f"text: {name}, {len(text):,} characters, {len(chars)} distinct; the last 10% held out")
    print(f"unigram baseline (entropy of the character frequencies): {baseline:.3f} nats/char")

    t, b = args.context, args.batch
    model = CharLM(len(chars), t, args.d_model, args.heads, args.layers, args.dropout)
    model.to(dev)
    opt = el.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(
        f"training on {dev}: {args.layers} TransformerEncoderLayers, "
        f"{sum(p.size for p in model.parameters()):,} parameters, context {t}, batch {b}"
    )
    text_dev = dev.tensor(data)  # resident on the device: a step sends only the window starts
    offsets = dev.arange(t)
    rng = np.random.default_rng(0)

    def batch(starts: np.ndarray) -> tuple[el.Tensor, el.Tensor]:
        idx = dev.tensor(starts).reshape(len(starts), 1) + offsets
        return text_dev.take(idx), text_dev.take(idx + 1)

    losses: list[float] = []
    sent_before = int(dev.stats()["bytes_sent"])
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(rng.integers(0, split - t - 1, b))
        loss = F.cross_entropy(model(x).reshape(b * t, len(chars)), y.reshape(b * t))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step % args.log_every == 0 or step == args.steps:
            recent = float(np.mean(losses[-args.log_every :]))
            print(f"step {step:4d}  loss {recent:.3f}  ({recent / baseline:.2f}x baseline)")
    elapsed = time.perf_counter() - start
    sent = (int(dev.stats()["bytes_sent"]) - sent_before) / args.steps
    if sent:  # a remote device: what a step sent, the first step's graph included
        print(f"{sent:,.0f} bytes sent per step on average")

    model.eval()
    with el.no_grad():
        windows = np.arange(split, len(data) - t - 1, t)  # the held-out text, window by window
        windows = windows[: len(windows) // b * b]
        held_out = np.mean([_loss(model, *batch(windows[i : i + b])) for i in range(0, len(windows), b)])
        print(f"held-out loss {held_out:.3f} nats/char; {elapsed:.1f} s of training")
        sample = generate(model, data[split : split + t], args.sample, chars, np.random.default_rng(1))
    print("sample (after a held-out prompt):")
    print(sample)


def _loss(model: CharLM, x: el.Tensor, y: el.Tensor) -> float:
    return float(F.cross_entropy(model(x).reshape(-1, model.head.out_features), y.reshape(-1)))


def generate(
    model: CharLM, prompt: np.ndarray, n: int, chars: Sequence[str], rng: np.random.Generator
) -> str:
    """`n` characters sampled one at a time; the window slides, so every step is the same graph."""
    dev = model.head.weight.device
    window = list(prompt)
    out = []
    for _ in range(n):
        logits = model(dev.tensor(np.array([window[-len(prompt) :]])))[0, -1].numpy().astype("float64")
        p = np.exp(logits - logits.max())
        nxt = int(rng.choice(len(chars), p=p / p.sum()))
        window.append(nxt)
        out.append(chars[nxt])
    return "".join(out)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a character-level transformer with emberlink.")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N, or a worker ticket (default: cpu)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sample", type=int, default=300, help="characters to generate")
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    with open_device(args.device) as dev:
        train(dev, args)


if __name__ == "__main__":
    main()
