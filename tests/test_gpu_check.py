"""The GPU check's dry run (CPU, tiny sizes): every part starts, finishes and writes its
results in the format the GPU run commits, so `make gpu-check` cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "gpu-check.json").read_text()), (out / "gpu-check.txt").read_text()


def test_every_part_runs_in_the_dry_run(dry_run) -> None:
    results, _ = dry_run
    assert results["dry_run"] is True
    names = [name for name, _ in _module().PARTS]
    assert list(results["parts"]) == names
    for name, part in results["parts"].items():
        assert part["status"] == "ok", (name, part.get("log_tail"))
        assert "result" in part, name


def test_dry_run_results_have_the_committed_format(dry_run) -> None:
    results, text = dry_run
    parts = {name: part["result"] for name, part in results["parts"].items()}
    assert parts["env"]["torch"] and parts["env"]["date"]
    resnet = parts["resnet"]["rows"]
    assert [r["variant"] for r in resnet] == ["fp", "ckpt", "L2", "L3", "L3-readback", "L4"]
    assert all(r["step_time_s"] > 0 and r["step_time_interval_s"] > 0 for r in resnet)
    assert resnet[0]["step_vs_fp"] == 1.0 and resnet[0]["interval_step_vs_fp"] == 1.0
    llama = parts["llama"]["rows"]
    assert [r["variant"] for r in llama] == ["sdpa", "ckpt", "act", "ckpt+act", "hooks:G2"]
    assert llama[0]["grad_cosine"] == pytest.approx(1.0)
    assert llama[1]["grad_cosine"] > 0.999  # checkpointing recomputes: the same gradients
    assert all(r["held_bytes"] > 0 for r in llama)
    # ACT and checkpointing + ACT keep less than plain sdpa even at the dry run's tiny size
    assert llama[2]["held_ratio_sdpa"] > 1 and llama[3]["held_ratio_ckpt"] > 1
    for variant in ("fp", "ckpt", "L3"):
        # the dry run's stand-in limit is 4: doubling from 2, then bisection down to it
        tries = parts[f"max-batch-{variant}"]["tries"]
        assert [t["batch"] for t in tries[:3]] == [2, 4, 8]
        assert all(t["fits"] == (t["batch"] <= 4) for t in tries)
        assert parts[f"max-batch-{variant}"]["max_batch"] == 4
    assert parts["profile"]["L3"]["ops"] > parts["profile"]["fp"]["ops"] > 0
    timed = parts["plan-time"]
    assert [r["share"] for r in timed["rows"]] == [0.4, 0.2, 0.1]
    first = timed["rows"][0]["plan"]  # the tiny Llama fits 40% of its exact bytes
    assert first["kept_bytes"] <= timed["rows"][0]["budget"] and first["tokens_per_s"] > 0
    assert "time plan at 40% of exact: plan" in text
    lines = text.splitlines()
    assert len([line for line in lines if line.startswith("resnet50 ")]) == 6
    sync = parts["sync"]  # counted on CUDA only; the dry run steps both models
    assert set(sync) >= {"fp", "L3", "syncs"} and sync["syncs"] is None
    assert "max batch: fp 4, ckpt 4, L3 4" in text
    compiled = parts["compiled"]["rows"]
    assert [r["variant"] for r in compiled] == ["fp", "L3"]
    assert compiled[0]["grad_cosine"] == pytest.approx(1.0) and compiled[1]["grad_cosine"] > 0.5
    assert len([line for line in lines if line.startswith("compiled resnet50 ")]) == 2


def test_a_part_past_its_cap_is_recorded_as_a_timeout(tmp_path) -> None:
    gpu_check = _module()
    args = Namespace(out=tmp_path, dry_run=True)
    res = gpu_check.run_part("resnet", 0.5, args)
    assert res["status"] == "timeout" and res["cap_s"] == 0.5
    assert "log_tail" in res


def test_budget_spent_skips_the_remaining_parts(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--dry-run", "--budget", "1"]
    done = subprocess.run([*cmd, "--parts", "env"], capture_output=True, text=True, check=False)
    assert done.returncode == 1  # a part that did not run is not a pass
    parts = json.loads((tmp_path / "gpu-check.json").read_text())["parts"]
    assert parts["env"] == {"status": "skipped", "seconds": 0.0, "why": "budget"}


def test_unknown_part_is_a_clear_error(tmp_path) -> None:
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--parts", "env,bogus"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "unknown parts ['bogus']" in done.stderr and "max-batch-L3" in done.stderr


def test_a_test_that_crashes_the_process_is_recorded_and_the_rest_still_run(
    tmp_path, monkeypatch
) -> None:
    """A segfault in one test (as a failing argument check of a native kernel gave on the
    H100) is named as ``crashed``, fails the part, and every other test still reports."""
    (tmp_path / "test_crash.py").write_text(
        "import os, signal\n"
        "def test_before():\n    assert True\n"
        "def test_crashes():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
        "def test_after():\n    assert False, 'a plain failure'\n"
    )
    module = _module()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "TEST_FILES", ["test_crash.py"])
    result = module.part_tests(False, tmp_path)
    assert result["crashed"] == ["test_crash.py::test_crashes"]
    assert result["returncodes"][0] < 0 and result["returncodes"][-1] == 1
    assert result["counts"]["tests"] == 2 and result["counts"]["failures"] == 1
    assert result["failed"][0].startswith("test_crash::test_after")
    assert result["part_ok"] is False
