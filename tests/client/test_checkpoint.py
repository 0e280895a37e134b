"""emberlink.save / emberlink.load: safetensors files that other tools read, streamed to and from devices."""

from __future__ import annotations

import io
import json
import os
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import emberlink as el
from emberlink import CheckpointError, Device, DTypeError, nn
from emberlink.checkpoint import CODES
from emberlink.protocol.identity import Identity

from ..process_harness import Process

DTYPES = list(CODES)


def sample(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Values that tell tensors apart: a sign and a fraction where the dtype has them."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def mixed_state(dev: Device) -> dict[str, el.Tensor | np.ndarray]:
    """Every dtype, a scalar, an empty tensor, odd sizes (alignment), tensors and arrays mixed."""
    state: dict[str, el.Tensor | np.ndarray] = {}
    for i, dtype in enumerate(DTYPES):
        state[f"layer.{i}.{dtype}"] = dev.tensor(sample(dtype, (3, 5), i))
        state[f"array.{dtype}"] = sample(dtype, (7,), 100 + i)
    state["scalar"] = dev.tensor(np.float32(2.5))
    state["empty"] = np.zeros((0, 4), np.float64)
    state["big_endian"] = np.arange(6, dtype=">i4").reshape(2, 3)
    state["strided"] = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    return state


def expected(state: dict[str, el.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.numpy() if isinstance(v, el.Tensor) else v) for k, v in state.items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype.newbyteorder("="), name
        assert got[name].shape == array.shape, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


# -- round trips ------------------------------------------------------------------------------------


def test_saved_tensors_and_arrays_load_back_with_their_names_dtypes_shapes_and_values(
    dev: Device, tmp_path: Path
) -> None:
    state = mixed_state(dev)
    el.save(state, tmp_path / "ck.safetensors")
    host = el.load(tmp_path / "ck.safetensors")
    assert all(type(a) is np.ndarray and a.flags.writeable for a in host.values())
    assert_same(host, expected(state))
    placed = el.load(str(tmp_path / "ck.safetensors"), device=dev)
    assert all(isinstance(t, el.Tensor) and t.device is dev for t in placed.values())
    assert_same({k: t.numpy() for k, t in placed.items()}, expected(state))


def test_the_safetensors_package_reads_what_save_writes(dev: Device, tmp_path: Path) -> None:
    state = mixed_state(dev)
    el.save(state, tmp_path / "ck.safetensors")
    assert_same(safetensors.numpy.load_file(tmp_path / "ck.safetensors"), expected(state))


def test_metadata_reaches_the_header_as_safetensors_reads_it(tmp_path: Path) -> None:
    el.save({"w": np.zeros(2, np.float32)}, tmp_path / "ck.safetensors", metadata={"format": "pt"})
    with safetensors.safe_open(tmp_path / "ck.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    assert list(el.load(tmp_path / "ck.safetensors")) == ["w"]
    with pytest.raises(CheckpointError, match="metadata must map strings to strings"):
        el.save(
            {"w": np.zeros(2)},
            tmp_path / "other.safetensors",
            metadata={"epoch": 3},  # type: ignore[dict-item]  # an int value on purpose
        )


def test_load_reads_what_the_safetensors_package_writes(dev: Device, tmp_path: Path) -> None:
    arrays = {f"t.{d}": sample(d, (4, 3), i) for i, d in enumerate(DTYPES)}
    arrays |= {"scalar": np.array(1.5, np.float16), "empty": np.zeros((2, 0), np.int64)}
    safetensors.numpy.save_file(arrays, tmp_path / "theirs.safetensors", metadata={"format": "np"})
    assert_same(el.load(tmp_path / "theirs.safetensors"), arrays)
    placed = el.load(tmp_path / "theirs.safetensors", device=dev)
    assert_same({k: t.numpy() for k, t in placed.items()}, arrays)


def test_a_model_trained_on_a_device_restores_from_its_checkpoint(dev: Device, tmp_path: Path) -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8, seed=0), nn.ReLU(), nn.Linear(8, 3, seed=1)).to(dev)

    trained = model()
    opt = el.optim.SGD(trained.parameters(), lr=0.1)
    x, y = dev.tensor(np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4)), dev.tensor([0, 1, 2, 1, 0])
    for _ in range(3):
        nn.functional.cross_entropy(trained(x), y).backward()
        opt.step()
        opt.zero_grad()
    el.save(trained.state_dict(), tmp_path / "model.safetensors")
    el.save(dict(trained.named_parameters()), tmp_path / "params.safetensors")  # tensors, read one by one
    for file in ("model.safetensors", "params.safetensors"):
        fresh = model()
        assert not np.array_equal(fresh(x).numpy(), trained(x).numpy())
        fresh.load_state_dict(el.load(tmp_path / file, device=dev))
        np.testing.assert_array_equal(fresh(x).numpy(), trained(x).numpy())


def test_loading_tensors_on_the_models_device_reads_nothing_back(
    dev: Device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = nn.Linear(3, 2, seed=5).to(dev)
    el.save(source.state_dict(), tmp_path / "ck.safetensors")
    target = nn.Linear(3, 2, seed=6).to(dev)
    loaded = el.load(tmp_path / "ck.safetensors", device=dev)

    def no_read(self: Device, v: object) -> np.ndarray:
        raise AssertionError("load_state_dict read a tensor back from the device")

    with monkeypatch.context() as patch:
        patch.setattr(Device, "_read", no_read)
        target.load_state_dict(loaded)
    for name, array in source.state_dict().items():
        np.testing.assert_array_equal(target.state_dict()[name], array)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(
    device_factory: Callable[[], Device], tmp_path: Path
) -> None:
    path = tmp_path / "ck.safetensors"
    el.save({"w": np.ones(3, np.float32)}, path)
    before = path.read_bytes()
    gone = device_factory()
    stale = gone.tensor(np.zeros(3, np.float32))
    gone.close()
    with pytest.raises(el.DeviceError):  # the second tensor cannot be read: its device is closed
        el.save({"w": np.full(3, 2.0, np.float32), "stale": stale}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.safetensors"]


def test_a_large_checkpoint_shows_one_progress_bar_on_a_terminal(
    dev: Device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emberlink.client import session

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(session, "PROGRESS_BYTES", 1 << 16)
    monkeypatch.setattr("sys.stderr", terminal)
    state = {f"w{i}": np.full(1 << 14, i, np.float32) for i in range(8)}  # 8 x 64 KiB
    el.save(state, tmp_path / "big.safetensors")
    loaded = el.load(tmp_path / "big.safetensors", device=dev)
    text = terminal.getvalue()
    assert "save big.safetensors" in text and "load big.safetensors" in text
    assert "/512k" in text  # one bar for the whole checkpoint (8 x 64 KiB), by bytes
    assert float(loaded["w7"].sum()) == 7 * (1 << 14)


# -- errors -----------------------------------------------------------------------------------------


def raw_file(path: Path, header: Mapping[str, object], data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def test_loading_a_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nowhere\.safetensors: file not found"):
        el.load(tmp_path / "nowhere.safetensors")


@pytest.mark.parametrize(
    ("keep", "says"),
    [
        (4, "holds only 4 bytes"),
        (40, "truncated: its header alone is"),
        (-1, "truncated: its header describes 512 bytes of tensors, the file holds 511"),
    ],
)
def test_a_truncated_file_is_reported_as_truncated(tmp_path: Path, keep: int, says: str) -> None:
    path = tmp_path / "ck.safetensors"
    el.save({"w": np.arange(64, dtype=np.float64)}, path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointError, match=says):
        el.load(path)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"PK\x03\x04" + bytes(200), "zip archive, as torch.save writes"),
        (b"\x80\x04\x95" + bytes(200), "Python pickle"),
        (b"just some text that is not a checkpoint at all", "not a safetensors file"),
        ((5).to_bytes(8, "little") + b"nope!", "header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "header is not a JSON object"),
    ],
)
def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=says):
        el.load(path)


@pytest.mark.parametrize(
    ("header", "data", "says"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "4 bytes follow"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "needs 12 bytes"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "back to back"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "has shape"),
        ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), "lacks dtype, shape or data_offsets"),
        ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype 'Q7'"),
    ],
)
def test_a_corrupt_header_is_refused_with_what_is_wrong(
    tmp_path: Path, header: dict[str, object], data: bytes, says: str
) -> None:
    with pytest.raises(CheckpointError, match=says):
        el.load(raw_file(tmp_path / "ck.safetensors", header, data))


def test_a_name_given_twice_in_a_file_is_refused(tmp_path: Path) -> None:
    entry = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    text = f'{{"w":{entry},"w":{entry}}}'.encode()
    path = tmp_path / "ck.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(4))
    with pytest.raises(CheckpointError, match="names 'w' twice"):
        el.load(path)


@pytest.mark.parametrize("code", [c for c in ("BF16", "F8_E4M3", "U32") if c not in CODES.values()])
def test_a_dtype_emberlink_cannot_hold_is_named_with_what_to_do(tmp_path: Path, code: str) -> None:
    nbytes = 2 * {"BF16": 2, "F8_E4M3": 1}.get(code, 4)  # two elements
    header = {
        "ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "w": {"dtype": code, "shape": [2], "data_offsets": [4, 4 + nbytes]},
    }
    path = raw_file(tmp_path / "ck.safetensors", header, bytes(4 + nbytes))
    with pytest.raises(
        DTypeError, match=rf"tensor 'w' is .*\({code}\), which emberlink cannot hold.*convert it"
    ):
        el.load(path)


def test_saving_an_entry_that_is_not_a_tensor_names_it(tmp_path: Path) -> None:
    for value in (3, [1.0, 2.0], {"momentum": np.zeros(2)}):
        with pytest.raises(CheckpointError, match=r"state\['step'\] is a \w+, not a Tensor or NumPy array"):
            state = {"w": np.zeros(2), "step": value}
            el.save(state, tmp_path / "ck.safetensors")  # type: ignore[arg-type]  # not a tensor on purpose
    assert not list(tmp_path.iterdir())  # checked before anything is written


def test_saving_refuses_names_the_format_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'__metadata__' is reserved"):
        el.save({"__metadata__": np.zeros(2)}, tmp_path / "ck.safetensors")
    with pytest.raises(CheckpointError, match="names must be strings, got int 0"):
        el.save({0: np.zeros(2)}, tmp_path / "ck.safetensors")  # type: ignore[dict-item]  # an int on purpose
    with pytest.raises(CheckpointError, match="mapping of names to tensors"):
        el.save(nn.Linear(2, 2), tmp_path / "ck.safetensors")  # type: ignore[arg-type]  # a Module on purpose


def test_saving_a_dtype_a_checkpoint_cannot_hold_names_the_entry(tmp_path: Path) -> None:
    with pytest.raises(DTypeError, match=r"state\['z'\] has dtype complex64"):
        el.save({"z": np.zeros(2, np.complex64)}, tmp_path / "ck.safetensors")


# -- streaming: client memory stays about one tensor -------------------------------------------------

TENSOR = 4 << 20
TENSORS = 20  # an 80 MiB checkpoint


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[Device]:
    """A worker in its own process, so the client's traced allocations are the client's alone."""
    worker_key, client_key = tmp_path / "worker.key", tmp_path / "client.key"
    Identity.generate(os.urandom).save(worker_key)
    Identity.generate(os.urandom).save(client_key)
    argv = [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0"]
    # The test builds its whole state in one segment: more work in one plan than a shared worker
    # runs by default (server/limits.py), so this single-user worker lifts the limit.
    argv += ["--max-plan-elements", "4G"]
    worker = Process([*argv, "--key", str(worker_key), "--allow-any"], tmp_path / "worker.log")
    try:
        ticket = worker.next_line(30)
        with Device.remote(ticket, key=str(client_key)) as dev:
            yield dev
    finally:
        worker.close()


def test_a_large_checkpoint_streams_to_and_from_a_remote_device_in_about_one_tensor_of_memory(
    worker_process: Device, tmp_path: Path
) -> None:
    dev = worker_process
    n = TENSOR // 4
    state = {f"layer.{i}": dev.arange(n, dtype="float32") + i for i in range(TENSORS)}
    dev.sync()
    path = tmp_path / "big.safetensors"
    tracemalloc.start()
    try:
        el.save(state, path)
        saved_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        loaded = el.load(path, device=dev)
        loaded_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert size > TENSORS * TENSOR
    print(
        f"checkpoint {size >> 20} MiB: peak client allocations {saved_peak >> 20} MiB saving, "
        f"{loaded_peak >> 20} MiB loading"
    )
    assert saved_peak < size / 4 and loaded_peak < size / 4
    for i in (0, TENSORS - 1):
        assert float((loaded[f"layer.{i}"] - state[f"layer.{i}"]).abs().max()) == 0.0
    np.testing.assert_array_equal(safetensors.numpy.load_file(path)["layer.3"][:3], [3.0, 4.0, 5.0])
