"""Tests of the loader of actcore's C++ CPU kernels: a failing toolchain warns once and
keeps the reference, the environment switch, switching in process, a forked child reuses
the parent's kernels, concurrent first builds (one of them killed) all end with working
kernels, the status command, the build plan's flags and the shipped source."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HAS_COMPILER

from actcore import ops
from actcore.native import build, cli, loader
from actcore.ops import quantization


# ------------------------------------------------------------------------------ loader
@pytest.fixture
def fresh_cpu_state(monkeypatch, tmp_path):
    """No CPU kernels registered, a loader that has not tried yet, an empty build cache."""
    before = loader.set_cpu_kernels(False, warn=False)
    saved = loader._CPU_STATE
    monkeypatch.setattr(loader, "_CPU_STATE", loader._CpuState())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ACTCORE_NATIVE", raising=False)
    monkeypatch.delenv("ACTCORE_NATIVE_CPU", raising=False)
    yield loader
    loader.set_cpu_kernels(False, warn=False)
    monkeypatch.setattr(loader, "_CPU_STATE", saved)
    loader.set_cpu_kernels(before, warn=False)


def test_failing_compiler_warns_once_and_the_reference_path_works(monkeypatch, fresh_cpu_state):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    x = torch.randn(3, 40)
    with pytest.warns(loader.NativeUnavailableWarning, match="CPU kernels unavailable"):
        packed = ops.quantize(x, 4, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        again = ops.quantize(x, 4, seed=3)
        y = ops.dequantize(again)
    assert torch.equal(packed.payload, again.payload)
    reference = quantization.quantize_reference(x, 4, 256, True, 3, True)
    assert torch.equal(packed.payload, reference[0])
    assert y.shape == x.shape and torch.all((y - x).abs() <= 1)
    info = fresh_cpu_state.cpu_status()
    assert not info["active"] and info["attempted"] and "actcore_native_cpu" in info["error"]
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("actcore::quantize", "CPU")


def test_turned_off_by_environment(monkeypatch, fresh_cpu_state):
    monkeypatch.setenv("ACTCORE_NATIVE_CPU", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.quantize(torch.randn(2, 16), 2, seed=1)
    info = fresh_cpu_state.cpu_status()
    assert not info["active"] and "ACTCORE_NATIVE_CPU" in info["error"]
    assert not info["built"]  # nothing was compiled
    monkeypatch.setenv("ACTCORE_NATIVE_CPU", "1")
    monkeypatch.setenv("ACTCORE_NATIVE", "off")
    assert fresh_cpu_state.cpu_disabled()


def test_switching_in_process_changes_the_dispatch(native_cpu):
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    x = torch.randn(4, 300)
    native = ops.quantize(x, 2, seed=5)
    with loader.cpu_kernels(False) as active:
        assert not active and not has_kernel("actcore::quantize", "CPU")
        reference = ops.quantize(x, 2, seed=5)
    assert loader.cpu_active() and has_kernel("actcore::quantize", "CPU")
    for a, b in zip(native.tensors(), reference.tensors(), strict=True):
        assert torch.equal(a, b)


def _child_round_trip(queue) -> None:  # runs in a forked process
    from actcore.native import build as child_build

    torch.set_num_threads(1)  # as DataLoader workers do

    def no_build(*args, **kwargs):
        raise AssertionError("a forked child must not build")

    child_build.build_cpu = no_build
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = ops.quantize(x, 3, seed=2).payload
    ref = quantization.quantize_reference(x, 3, 256, True, 2, True)[0]
    queue.put((loader.cpu_active(), torch.equal(p, ref)))


@pytest.mark.skipif(sys.platform == "win32", reason="no fork")
def test_forked_child_reuses_the_kernels(native_cpu):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_round_trip, args=(queue,))
    child.start()
    result = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert result == (True, True)


_FIRST_USE = textwrap.dedent(
    """
    import sys, warnings, torch
    warnings.simplefilter("error")
    from actcore import ops
    from actcore.native import loader
    from actcore.ops import quantization
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    p = ops.quantize(x, 3, seed=7).payload
    ref = quantization.quantize_reference(x, 3, 256, True, 7, True)[0]
    assert loader.cpu_active(), loader.cpu_status()
    assert torch.equal(p, ref)
    print("ok", loader.cpu_status()["library"])
    """
)


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C++ compiler")
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_concurrent_first_builds_survive_a_killed_builder(tmp_path):
    """Processes build into one empty cache at once; the first builder is killed mid-build.

    The others wait on the build directory's lock (released by the kernel when its holder
    dies), then build or load, and end with working kernels and no warning.
    """
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "MAX_JOBS": "1"}
    env.pop("ACTCORE_NATIVE", None)
    env.pop("ACTCORE_NATIVE_CPU", None)
    cmd = [sys.executable, "-c", _FIRST_USE]

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    first = start()
    deadline = time.monotonic() + 300
    while not list(cache.glob("actcore/native/cpu-*/build.ninja")):  # it is compiling
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first process never started its build"
        time.sleep(0.2)
    others = [start(), start()]
    time.sleep(2)
    os.killpg(first.pid, signal.SIGKILL)  # the builder and its compiler
    first.wait()
    results = [p.communicate(timeout=900) for p in others]
    for proc, (out, err) in zip(others, results, strict=True):
        assert proc.returncode == 0, out + err
        assert out.startswith("ok ")
    libraries = {out.split()[1] for out, _ in results}
    assert len(libraries) == 1 and str(tmp_path) in libraries.pop()


def test_status_reports_the_cpu_kernels(native_cpu, capsys):
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels" in out and "active" in out
    info = loader.status()
    assert info["cpu"]["active"] and info["cpu"]["build_dir"]


@pytest.mark.skipif(
    not build.cpu_openmp_flags(), reason="torch's CPU ops do not run on OpenMP here"
)
def test_kernels_run_on_torchs_threads(native_cpu):
    """Built with OpenMP, as ATen's parallel backend needs: without it at::parallel_for ran
    every kernel on one thread. The library follows ``torch.set_num_threads``."""
    handle = loader._CPU_STATE.handle
    assert handle is not None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert handle.actcore_cpu_parallel_threads() == 2
        assert loader.status()["cpu"]["threads"] == 2
        torch.set_num_threads(1)
        assert handle.actcore_cpu_parallel_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_plan_flags_keep_exactness():
    plan = build.plan_cpu_build()
    if sys.platform != "win32":
        assert "-ffp-contract=off" in plan.cxx_flags
        assert not any("fast-math" in f and "no" not in f for f in plan.cxx_flags)
        assert not any(f.startswith("-march") for f in plan.cxx_flags)
    assert plan.sources[0].name == "cpu_kernels.cpp" and plan.sources[0].is_file()
    assert plan.build_dir.name.startswith("cpu-")


def test_cpu_source_ships_as_package_data():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "csrc/*.cpp" in text
    assert (Path(build.__file__).parent / "csrc" / "cpu_kernels.cpp").is_file()
