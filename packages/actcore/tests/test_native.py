"""Tests of actcore.native: the CUDA build (compile check, toolchain discovery, failures that
fall back to the reference) and, on a GPU, the kernels' bit-exactness against the reference.

The compile check runs everywhere nvcc is installed (CI included): one architecture
(sm_90), two translation units, cached by a digest of the sources. GPU tests are skipped
without a CUDA device.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from native_cases import (
    OPCHECK_CASES,
    assert_same,
    bit_exact_inputs,
    check_errors_are_clear,
    check_masked_ops,
    opcheck_cases,
)

from actcore import ops
from actcore.native import build, cli, loader, toolkit
from actcore.ops import bitpack, noise, quantization

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")


def _toolkit_or_none() -> build.CudaToolkit | None:
    try:
        return build.find_cuda_toolkit()
    except build.NativeBuildError:
        return None


needs_nvcc = pytest.mark.skipif(
    _toolkit_or_none() is None or torch.version.cuda is None,
    reason="needs the CUDA toolkit (nvcc) and a CUDA build of torch",
)


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has not tried to load yet (the process-wide state is restored after)."""
    monkeypatch.setattr(loader, "_STATE", loader._State())
    return loader


# ------------------------------------------------------------------------------ build
@needs_nvcc
def test_compile_check_for_sm90_succeeds():
    """`actcore native build --check` compiles and links for sm_90, no GPU needed (CI)."""
    cmd = [sys.executable, "-m", "actcore.native", "build", "--check", "--arch", "9.0"]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compile check passed" in done.stdout
    plan = build.plan_build(arch="9.0")
    assert plan.library.is_file()
    assert "-gencode=arch=compute_90,code=sm_90" in plan.cuda_flags


def test_plan_finds_sources_and_flags_for_exactness():
    src = build.source_dir()
    for name in build.SOURCES + build.HEADERS:
        assert (src / name).is_file()
    for flag in ("--fmad=false", "--ftz=false", "--prec-div=true"):
        assert flag in build.CUDA_FLAGS


@needs_nvcc
def test_toolkit_root_is_the_real_one_not_the_parent_of_a_wrapper():
    toolkit = build.find_cuda_toolkit()
    assert (toolkit.root / "bin" / "nvcc").is_file()
    assert (toolkit.root / "include" / "cuda_runtime.h").is_file()
    assert toolkit.version.split(".")[0] == torch.version.cuda.split(".")[0]


@needs_nvcc
def test_build_dir_is_cached_per_sources_and_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, b = build.plan_build(arch="9.0"), build.plan_build(arch="9.0")
    assert a.build_dir == b.build_dir and a.build_dir.is_relative_to(tmp_path / "actcore")
    assert build.plan_build(arch="8.0").build_dir != a.build_dir
    src = tmp_path / "src"
    shutil.copytree(build.source_dir(), src)
    (src / "kernels.cu").write_text((src / "kernels.cu").read_text() + "\n// changed\n")
    monkeypatch.setattr(build, "source_dir", lambda: src)
    assert build.plan_build(arch="9.0").build_dir != a.build_dir  # sources changed: rebuild


def test_arch_parsing_and_flags():
    assert build.parse_arches("8.0;9.0+PTX") == ["8.0", "9.0+PTX"]
    assert build.parse_arches(" 8.6, 9.0a ") == ["8.6", "9.0a"]
    assert build.gencode_flags(["9.0+PTX"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert build.arch_label("9.0") == "sm_90"
    with pytest.raises(ValueError, match="'Hopper'"):
        build.parse_arches("Hopper")


def test_default_arch_without_gpu_is_sm90(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert build.default_arches() == ["9.0"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0")
    assert build.default_arches() == ["8.0", "9.0"]


def test_bad_cuda_home_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    with pytest.raises(build.NativeBuildError, match=r"CUDA_HOME=.*nowhere.*not a CUDA toolkit"):
        build.find_cuda_toolkit()
    assert cli.main(["build", "--check"]) == 1


def test_no_toolkit_anywhere_is_a_clear_error(monkeypatch, tmp_path):
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(toolkit, "_is_toolkit", lambda root: False)
    with pytest.raises(build.NativeBuildError, match="no CUDA toolkit found"):
        build.find_cuda_toolkit()


def test_failing_toolchain_warns_once_and_the_reference_path_works(monkeypatch, fresh_loader):
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/cuda")
    monkeypatch.delenv("ACTCORE_NATIVE", raising=False)
    with pytest.warns(loader.NativeUnavailableWarning, match="CUDA_HOME"):
        assert fresh_loader.load() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second attempt neither retries nor warns
        assert fresh_loader.load() is False
        assert fresh_loader.ready("quantize") is False
    info = fresh_loader.status()
    assert info["loaded"] is False and "CUDA_HOME" in info["error"]
    assert info["toolkit"] is None and "CUDA_HOME" in info["toolkit_error"]
    x = torch.randn(3, 40)
    y = ops.dequantize(ops.quantize(x, 4, seed=3))
    assert y.shape == x.shape and torch.all((y - x).abs() <= 1)


def test_native_off_by_environment(monkeypatch, fresh_loader):
    monkeypatch.setenv("ACTCORE_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_loader.load() is False
    assert "ACTCORE_NATIVE" in fresh_loader.status()["error"]


def test_cpu_ops_never_trigger_a_build(fresh_loader):
    x = torch.randn(2, 64)
    ops.dequantize(ops.quantize(x, 2, seed=1))
    ops.unpack_mask(ops.pack_mask(x > 0), x.shape)
    ops.hash_uniform(torch.arange(10), 5)
    assert not fresh_loader.status()["attempted"]


@needs_nvcc
def test_compile_error_fails_the_check(monkeypatch, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(build.source_dir(), src)
    for name in build.SOURCES:  # a fatal error at once, in both translation units
        (src / name).write_text('#include "deliberately_broken.h"\n' + (src / name).read_text())
    monkeypatch.setattr(build, "source_dir", lambda: src)
    plan = build.plan_build(arch="9.0", build_dir=tmp_path / "build")
    with pytest.raises(build.NativeBuildError, match=r"deliberately_broken\.h"):
        build.build(plan)
    assert cli.main(["build", "--check", "--build-dir", str(tmp_path / "build2")]) == 1


def test_cli_registers_a_native_command():
    import argparse

    parser = argparse.ArgumentParser(prog="actcore")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["native", "build", "--check"])
    assert args.check and args.arch is None and args.func is cli.run_build
    args = parser.parse_args(["native", "status", "--json"])
    assert args.func is cli.run_status
    with pytest.raises(SystemExit):
        parser.parse_args(["native"])


def test_status_command_prints(capsys, fresh_loader):
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    for key in ("kernels loaded", "devices", "CUDA toolkit", "build dir"):
        assert key in out


def test_sources_ship_as_package_data():
    """The wheel carries csrc/ (pyproject package-data) under actcore/native/csrc."""
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    text = pyproject.read_text()
    assert '"actcore.native"' in text and "csrc/*.cu" in text
    packaged = Path(build.__file__).parent / "csrc"
    assert all((packaged / n).is_file() for n in build.SOURCES + build.HEADERS)


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def native():
    if os.environ.get("ACTCORE_NATIVE", "").lower() in ("0", "off", "false", "no"):
        pytest.skip("native kernels turned off by ACTCORE_NATIVE")
    if _toolkit_or_none() is None:
        pytest.skip("no CUDA toolkit (nvcc) here to build the kernels with")
    if not loader.load(warn=False):  # a toolkit and a GPU: a failure is a bug
        pytest.fail(f"the CUDA kernels did not load on a GPU machine: {loader.status()['error']}")
    return loader


def _quantize_both(x, bits, group_size, stochastic, seed, per_sample):
    native = torch.ops.actcore.quantize.default(
        x.cuda(), bits, group_size, stochastic, seed, per_sample
    )
    reference = quantization.quantize_reference(x, bits, group_size, stochastic, seed, per_sample)
    return native, reference


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_and_dequantize_are_bit_exact(native, dtype):
    seed = 0x5EED_1234_5678
    for name, x in bit_exact_inputs(dtype):
        for bits in range(1, 9):
            for group_size in (8, 24, 64, 256, 512, 2048):  # 2048: blocks past registers
                for stochastic, per_sample in ((True, True), (False, True), (True, False)):
                    what = f"{name} {tuple(x.shape)} {dtype} bits={bits} G={group_size} "
                    what += f"stochastic={stochastic} per_sample={per_sample}"
                    args = (bits, group_size, stochastic, seed, per_sample)
                    (p, lo, st), (rp, rlo, rst) = _quantize_both(x, *args)
                    assert_same(p, rp, f"payload of {what}")
                    assert_same(lo, rlo, f"lo of {what}")
                    assert_same(st, rst, f"step of {what}")
                    shape = list(x.shape)
                    y = torch.ops.actcore.dequantize.default(
                        p, lo, st, bits, group_size, shape, dtype, per_sample
                    )
                    ry = quantization.dequantize_reference(
                        rp, rlo, rst, bits, group_size, shape, dtype, per_sample
                    )
                    assert_same(y, ry, f"dequantize of {what}")
                    assert y.device.type == "cuda" and y.is_contiguous()


@needs_gpu
def test_front_end_uses_the_kernels_on_cuda(native):
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert all(has_kernel(f"actcore::{op}", "CUDA") for op in loader.OPS)
    x = torch.randn(8, 1000, device="cuda", dtype=torch.bfloat16)
    packed = ops.quantize(x, 3, seed=99)
    reference = quantization.quantize_reference(x.cpu(), 3, 256, True, 99, True)
    assert_same(packed.payload, reference[0], "payload")
    y = ops.dequantize(packed)
    assert y.device == x.device and y.dtype == x.dtype


@needs_gpu
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_and_unpack_bits_are_bit_exact(native, bits):
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 63, 64, 1000, 4097):
        values = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)  # high bits too
        packed = torch.ops.actcore.pack_bits.default(values.cuda(), bits)
        assert_same(packed, bitpack.pack_bits_reference(values, bits), f"pack n={n}")
        for numel in {n, max(0, n - 3)}:
            out = torch.ops.actcore.unpack_bits.default(packed, bits, numel)
            ref = bitpack.unpack_bits_reference(packed.cpu(), bits, numel)
            assert_same(out, ref, f"unpack n={n} numel={numel}")
    strided = torch.randint(0, 2**bits, (30, 17), generator=g, dtype=torch.uint8)
    assert_same(
        torch.ops.actcore.pack_bits.default(strided.cuda().t(), bits),
        bitpack.pack_bits_reference(strided.t(), bits),
        "pack of a transposed tensor",
    )
    odd = torch.randint(0, 2**bits, (1003,), generator=g, dtype=torch.uint8)
    for start in (3, 5):  # a storage offset: blocks of 8 start unaligned
        assert_same(
            torch.ops.actcore.pack_bits.default(odd.cuda()[start:], bits),
            bitpack.pack_bits_reference(odd[start:].clone(), bits),
            f"pack at offset {start}",
        )


@needs_gpu
def test_masks_round_trip_on_cuda(native):
    mask = torch.rand(3, 1001, device="cuda") > 0.5
    packed = ops.pack_mask(mask)
    assert_same(packed, ops.pack_mask(mask.cpu()), "packed mask")
    assert torch.equal(ops.unpack_mask(packed, mask.shape), mask)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_ops_are_bit_exact_on_cuda(native, dtype):
    check_masked_ops("cuda", dtype)


@needs_gpu
def test_hash_uniform_is_bit_exact_on_64bit_indices(native):
    big = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3, 2**62, 2**63 - 1]
    big += [-1, -2, -(2**31), -(2**32) - 7, -(2**63)]
    index = torch.tensor(big, dtype=torch.int64)
    for seed in (0, 1, 0x1234_5678_9ABC, 2**63 - 1):
        out = torch.ops.actcore.hash_uniform.default(index.cuda(), seed)
        assert_same(out, noise.uniform_noise(index, seed), f"hash seed={seed}")
    layouts = {
        "contiguous": torch.arange(2**32 - 500, 2**32 + 500).view(20, 50),
        "transposed": torch.arange(1000).view(20, 50).t(),
        "sliced": torch.arange(3000).view(30, 100)[:, ::7],
    }
    for name, idx in layouts.items():
        out = torch.ops.actcore.hash_uniform.default(idx.cuda(), 77)
        ref = noise.uniform_noise(idx, 77)
        assert_same(out, ref, f"hash of a {name} index")
        assert out.stride() == torch.empty_like(idx, dtype=torch.float32).stride(), name
    empty = torch.ops.actcore.hash_uniform.default(torch.empty(0, 3, dtype=torch.int64).cuda(), 1)
    assert empty.shape == (0, 3) and empty.dtype == torch.float32


@needs_gpu
@pytest.mark.skipif(
    not HAS_GPU or torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs a GPU with 40 GiB",
)
def test_past_2_32_elements(native):
    """64-bit indexing: one row of 2**32 + 2000 bf16 elements; the noise key changes at 2**32."""
    n = 2**32 + 2000
    group_size, bits, seed = 256, 4, 4242
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(0))
    payload, lo, step = torch.ops.actcore.quantize.default(x, bits, group_size, True, seed, False)
    assert payload.shape == (1, math.ceil(n / 8) * bits)
    y = torch.ops.actcore.dequantize.default(
        payload, lo, step, bits, group_size, [n], torch.bfloat16, False
    )
    for start in (0, 2**31 - 1024, 2**32 - 1024, n - 2000):  # group-aligned windows
        stop = min(n, start + 2048)
        tail = x[start:stop].cpu().float()
        g0, g1 = start // group_size, -(-stop // group_size)
        _, rlo, rst = quantization.quantize_reference(tail, bits, group_size, False, 0, False)
        assert_same(lo[0, g0:g1], rlo[0], f"lo at {start}")
        assert_same(step[0, g0:g1], rst[0], f"step at {start}")
        # codes by the reference's own formula, with the noise of the true 64-bit indices
        idx = torch.arange(start, stop, dtype=torch.int64)
        u = noise.uniform_noise(idx, seed)
        cols = torch.arange(stop - start) // group_size
        lo_c, st_c = rlo[0, cols].float(), rst[0, cols].float()
        v = ((tail - lo_c) / st_c).masked_fill(st_c == 0, 0.0)
        expected = (v + u).floor().clamp(0, 2**bits - 1).nan_to_num(0).to(torch.uint8)
        b0, b1 = start // 8 * bits, -(-stop // 8) * bits
        codes = bitpack.unpack_bits_reference(payload[0, b0:b1].cpu(), bits, stop - start)
        assert_same(codes, expected, f"codes at {start}")
        ry = quantization.dequantize_reference(
            payload[:, b0:b1].cpu(),
            rlo,
            rst,
            bits,
            group_size,
            [stop - start],
            torch.bfloat16,
            False,
        )
        assert_same(y[start:stop], ry, f"dequantize at {start}")


@needs_gpu
@pytest.mark.parametrize("case", range(OPCHECK_CASES))
def test_opcheck_on_cuda(native, case):
    op, args = opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args)


@needs_gpu
def test_native_errors_are_clear(native):
    check_errors_are_clear("cuda")
