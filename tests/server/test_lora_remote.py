"""LoRA and QLoRA through a worker: what a fine-tuning step sends, and what the frozen weights occupy."""

from __future__ import annotations

import gc

import numpy as np

import emberlink as el
from emberlink import nn
from emberlink.testing import InProcessWorker

from .server_harness import memory_device

F = nn.functional


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, hidden, seed=0),
        nn.ReLU(),
        nn.Linear(hidden, hidden, seed=1),
        nn.ReLU(),
        nn.Linear(hidden, 4, seed=2),
    )


def weight_bytes(model: nn.Module) -> int:
    return sum(
        p.size * np.dtype(p.dtype).itemsize for name, p in model.named_parameters() if "weight" in name
    )


def step_bytes(dev: el.Device, model: nn.Module, steps: int) -> list[int]:
    """Bytes the client sent for each fine-tuning step, besides the batch's own."""
    opt = el.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    sent = []
    for _ in range(steps):
        x, y = rng.standard_normal((16, 32), dtype=np.float32), rng.integers(0, 4, 16)
        before = int(dev.stats()["bytes_sent"])
        loss = F.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        float(loss)
        sent.append(int(dev.stats()["bytes_sent"]) - before - x.nbytes - y.nbytes)
    return sent


def test_a_lora_step_sends_no_base_weights_whatever_their_size(worker: InProcessWorker) -> None:
    sent = {}
    for hidden in (16, 512):
        with memory_device(worker) as dev:
            model = nn.add_lora(mlp(hidden).to(dev), rank=4)
            sent[hidden] = step_bytes(dev, model, 5)
    # The first step carries the upload of the model and the second registers Adam's steady-state
    # graph; after that a step names the resident weights and sends the same few hundred bytes for
    # a 4 KiB model and for a 1 MiB one.
    assert sent[512][0] > weight_bytes(mlp(512))
    assert max(sent[512][1:]) < weight_bytes(mlp(512)) / 100
    assert sent[512][2:] == sent[16][2:]
    assert max(sent[512][2:]) < weight_bytes(mlp(512)) / 1000


def test_qlora_base_weights_take_under_0_3_of_their_float32_bytes_on_the_worker(
    worker: InProcessWorker,
) -> None:
    with memory_device(worker) as dev:
        start = dev.memory_stats()["in_use_bytes"]
        model = mlp(512).to(dev)
        dev.sync()
        f32 = dev.memory_stats()["in_use_bytes"] - start
        assert f32 >= weight_bytes(model)
        model = nn.add_lora(model, rank=4, quantize="int8")  # quantized on the worker
        gc.collect()  # the float32 weights' handles die, and the next flush tells the worker
        dev.sync()
        resident = dev.memory_stats()["in_use_bytes"] - start
        # Resident now: the int8 weights and their scales, the float biases and the adapters.
        adapters = sum(p.size * 4 for p in model.parameters() if p.requires_grad)
        biases = f32 - weight_bytes(mlp(512))
        frozen_weights = resident - adapters - biases
        assert frozen_weights <= 0.3 * (f32 - biases)
        int8 = sum(p.size for p in model.parameters() if p.dtype == "int8")
        assert frozen_weights >= int8  # the measure is the worker's store: nothing left uncounted
