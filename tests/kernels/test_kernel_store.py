"""KernelStore: a compiled kernel is named by its function, closure, argument layout and options, kept on
disk, and loaded by the next process without tracing; anything it can't name is compiled as before."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bubo.kernels import compiled, decode_attention, kernel_store
from bubo.kernels.compiled import DynamicKernel, StaticKernel
from bubo.kernels.kernel_store import KernelStore
from bubo.kernels.super_block_matvec import SUPER_BLOCK_FORMATS, _matvec_kernel

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KernelStore:
    store = KernelStore(tmp_path / "kernels")
    monkeypatch.setattr(compiled, "kernel_store", lambda: store)
    return store


def _no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("traced, not loaded from the store")

    monkeypatch.setattr(compiled, "_trace", refuse)


# Compiles a Q4_1 matvec kernel (the module's own, as a model's load does; the float one, which inductor
# compiles) and prints its result's bytes and how many graphs were traced. The store and inductor's caches
# are the environment's.
_SCRIPT = textwrap.dedent(
    """
    import sys
    import gguf, numpy as np, torch
    from bubo.kernels import compiled
    from bubo.kernels.q4_matvec import pack_q4, q4_matvec
    from bubo.options import current_options, use_options

    use_options(current_options().changed(int8_matvec=False))
    traced = []
    trace = compiled._trace
    compiled._trace = lambda *args: traced.append(1) or trace(*args)
    rng = np.random.default_rng(5)
    raw = gguf.quants.quantize(rng.standard_normal((48, 96), dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)
    x = torch.from_numpy(rng.standard_normal(96, dtype=np.float32))
    with torch.inference_mode():
        y = q4_matvec(x, pack_q4(torch.from_numpy(raw), gguf.GGMLQuantizationType.Q4_1))
    print(len(traced), y.numpy().tobytes().hex())
    """
)


def test_the_next_process_loads_a_kernel_without_tracing_it(tmp_path: Path) -> None:
    env = {**os.environ, "BUBO_KERNEL_CACHE": str(tmp_path / "kernels")}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        traced, result = done.stdout.split()
        runs.append((int(traced), result))
    (first_traced, first), (second_traced, second) = runs
    assert first_traced == 1 and second_traced == 0
    assert second == first
    rng = np.random.default_rng(5)
    raw = gguf.quants.quantize(rng.standard_normal((48, 96), dtype=np.float32), Q.Q4_1)
    x = rng.standard_normal(96, dtype=np.float32)
    expected = gguf.quants.dequantize(raw, Q.Q4_1).astype(np.float64) @ x.astype(np.float64)
    got = np.frombuffer(bytes.fromhex(second), dtype=np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5)


def test_a_stored_dynamic_kernel_takes_every_length(
    store: KernelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 1, 64, generator=g)
    pool = torch.randn(2, 3, 600, 64, generator=g)

    def attend(kernel: DynamicKernel, length: int) -> torch.Tensor:
        keys, values = pool[0, None, :, 5 : 5 + length], pool[1, None, :, 5 : 5 + length]
        with torch.inference_mode():
            return kernel(q, keys, values)

    attend(DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)}), 7)
    _no_tracing(monkeypatch)
    loaded = DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)})
    for length in (1, 7, 40, 530):
        keys, values = pool[0, None, :, 5 : 5 + length], pool[1, None, :, 5 : 5 + length]
        expected = decode_attention.decode_attention_reference(q.double(), keys.double(), values.double())
        torch.testing.assert_close(attend(loaded, length).double(), expected, rtol=1e-5, atol=1e-6)
    assert len(loaded._compiled) == 1


def test_a_kernel_returning_several_tensors_keeps_their_structure(
    store: KernelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A graph may return a tuple; a stored artifact gives a flat list back. The function is named as
    # Bubo's so that the store takes it (a test's own code is not in its hash).
    x, w = torch.randn(2, 4), torch.randn(8, 4)

    def project(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple((x @ w.T).split((3, 5), dim=-1))

    project.__module__ = "bubo.engine.compiled_decode"
    StaticKernel(project)(x, w)
    _no_tracing(monkeypatch)
    got = StaticKernel(project)(x, w)
    assert isinstance(got, tuple) and len(got) == 2
    expected = (x @ w.T).split((3, 5), dim=-1)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_names_follow_the_closure_the_layout_and_the_options(store: KernelStore) -> None:
    q4k, q6k = (_matvec_kernel(SUPER_BLOCK_FORMATS[t]).fn for t in (Q.Q4_K, Q.Q6_K))
    layout = ((torch.Size([2, 4]), (4, 1), torch.float32),)
    args = (torch.empty(2, 4),)
    name = store.name(q4k, layout, {"a": 1}, args)
    assert name is not None and name == store.name(q4k, layout, {"a": 1}, args)
    assert store.name(q6k, layout, {"a": 1}, args) != name
    assert store.name(q4k, ((torch.Size([2, 8]), (8, 1), torch.float32),), {"a": 1}, args) != name
    assert store.name(q4k, layout, {"a": 2}, args) != name
    # Not nameable: a function from outside Bubo (its code is not in the source hash), a closure over
    # a tensor (its values would be constants of the graph), arguments off the CPU.
    assert store.name(lambda x: x, layout, {}, args) is None
    weight = torch.ones(3)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * weight

    scaled.__module__ = "bubo.kernels.compiled"
    assert store.name(scaled, layout, {}, args) is None
    assert store.name(q4k, layout, {}, (torch.empty(2, 4, device="meta"),)) is None


def test_a_damaged_stored_kernel_is_compiled_again(
    store: KernelStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    g = torch.Generator().manual_seed(4)
    q, keys, values = torch.randn(1, 4, 1, 32, generator=g), *torch.randn(2, 1, 4, 9, 32, generator=g)
    DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)})(q, keys, values)
    (stored,) = store.root.rglob("*.bin")
    stored.write_bytes(stored.read_bytes()[:100])
    got = DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)})(q, keys, values)
    assert "did not load" in caplog.text and "could not compile" not in caplog.text
    expected = decode_attention.decode_attention_reference(q.double(), keys.double(), values.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # Stored again, whole: the next kernel loads it.
    _no_tracing(monkeypatch)
    DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)})(q, keys, values)
    assert json.loads(next(store.root.rglob("*.json")).read_text())["outputs"]


def test_the_store_can_be_turned_off(runtime_options, tmp_path: Path) -> None:
    runtime_options(kernel_cache="off")
    assert kernel_store.kernel_store() is None
    runtime_options(kernel_cache=str(tmp_path))
    assert kernel_store.kernel_store().root == tmp_path


def test_directories_of_other_source_versions_are_removed_after_a_week(store: KernelStore) -> None:
    old, recent = store.root / "0123456789abcdef", store.root / "fedcba9876543210"
    for directory in (old, recent):
        directory.mkdir(parents=True)
        (directory / "k.bin").write_bytes(b"")
    week_and_a_day = time.time() - 8 * 24 * 3600
    os.utime(old, (week_and_a_day, week_and_a_day))
    g = torch.Generator().manual_seed(6)
    q, keys, values = torch.randn(1, 2, 1, 16, generator=g), *torch.randn(2, 1, 2, 5, 16, generator=g)
    DynamicKernel(decode_attention._attend, dynamic={1: (2,), 2: (2,)})(q, keys, values)
    assert not old.exists() and recent.exists()
    assert [p.name for p in store.root.iterdir() if p.name not in (recent.name,)] == [kernel_store._SOURCE]


def test_a_store_that_cannot_be_written_is_skipped_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    store = KernelStore(blocked / "kernels")
    monkeypatch.setattr(compiled, "kernel_store", lambda: store)
    g = torch.Generator().manual_seed(8)
    q, keys, values = torch.randn(1, 2, 1, 16, generator=g), *torch.randn(2, 1, 2, 5, 16, generator=g)
    expected = decode_attention.decode_attention_reference(q.double(), keys.double(), values.double())
    for kernel in (decode_attention._attend, decode_attention._attend_causal):
        got = DynamicKernel(kernel, dynamic={1: (2,), 2: (2,)})(q, keys, values)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "not stored" in warnings[0].getMessage()


def test_kernels_call_inductors_generated_code_directly(
    store: KernelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Compiled now and loaded from the store, a kernel calls inductor's generated code itself where
    # AOTAutograd's runtime wrapper around it has nothing to do, else that wrapper; torch building the
    # wrappers differently would lose tens of microseconds a call silently (the artifact is then called as
    # it is), so it fails here instead. A graph updating an input in place (a DeltaNet layer's state) is
    # called directly, and its update lands; an output that is a view of an input keeps the wrapper, which
    # rebuilds it as a view of the caller's tensor.
    found = []
    direct = compiled._direct_call

    def spy(artifact: object, outputs: object, loaded: bool) -> object:
        runtime = compiled._runtime_wrapper(artifact)
        found.append((loaded, runtime is not None and compiled._generated_call(runtime) is not None))
        return direct(artifact, outputs, loaded)

    monkeypatch.setattr(compiled, "_direct_call", spy)
    x, w = torch.randn(2, 4), torch.randn(8, 4)

    def scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w.T) * 2

    def decayed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w.mul_(0.5).add_(x.sum())
        return w.sum(0)

    def project(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple((x @ w.T).split((3, 5), dim=-1))

    def transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w.T

    for fn in (scaled, decayed, project, transposed):
        fn.__module__ = "bubo.engine.compiled_decode"  # stored, as Bubo's own functions are
        for _ in range(2):  # compiled, then loaded
            for grad in (False, True):  # with grad enabled the wrapper runs (it turns grad off)
                state, reference = w.clone(), w.clone()
                with torch.set_grad_enabled(grad):
                    got = StaticKernel(fn)(x, state)
                expected = fn(x, reference)
                torch.testing.assert_close(state, reference)
                if isinstance(expected, tuple):
                    assert isinstance(got, tuple) and len(got) == len(expected)
                    for a, b in zip(got, expected, strict=True):
                        torch.testing.assert_close(a, b)
                else:
                    torch.testing.assert_close(got, expected)
    # Each function compiled once, then loaded by each new kernel; called directly but for `transposed`.
    direct = [True] * 12 + [False] * 4
    assert found == [(i % 4 != 0, d) for i, d in enumerate(direct)]
