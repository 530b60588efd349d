"""The ``actcore`` command line: argument errors, JSON results, tiny end-to-end runs, Ctrl-C."""

from __future__ import annotations

import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli

import actcore
from actcore import cli
from actcore.bench import accuracy, memory, report, sweep
from actcore.bench.routes import HOOKS_UNAVAILABLE

TINY = ["--model", "tiny-cnn", "--batch", "4", "--steps", "1", "--quiet", "--threads", "1"]
ENVELOPE = {"benchmark", "machine", "torch", "date", "command", "config", "partial", "rows"}


pytestmark = pytest.mark.usefixtures("one_thread")


def load(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert set(data) >= ENVELOPE
    return data


# --------------------------------------------------------------------------------------------
# argument errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["memory", "accuracy", "sweep", "max-batch"])
def test_unknown_level_names_it_and_the_valid_ones(command, capsys):
    assert run_cli(["bench", command, "--levels", "fp,L9"]) == 2
    err = capsys.readouterr().err
    assert "'L9'" in err
    for level in ["fp", *actcore.LEVELS]:
        assert level in err


def test_unknown_model_lists_the_choices(capsys):
    assert run_cli(["bench", "memory", "--model", "resnet5"]) == 2
    err = capsys.readouterr().err
    assert "'resnet5'" in err and "tiny-cnn" in err and "digits-cnn" in err
    pytest.importorskip("torchvision")
    assert "resnet50" in err and "did you mean" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["bench", "accuracy", "--task", "mnist"], ["'mnist'", "digits"]),
        (["bench", "memory", "--batch", "0"], ["positive integer", "0"]),
        (["bench", "memory", "--route", "graph"], ["'graph'", "layers", "hooks"]),
        (["bench", "sweep", "--batches", "2,x"], ["--batches", "2,x"]),
        (["bench", "kernels", "--bits", "9"], ["--bits", "1..8", "9"]),
        (["bench", "memory", "--threads", "0"], ["--threads", ">= 1", "0"]),
        (["bench", "frobnicate"], ["'frobnicate'", "memory", "accuracy", "max-batch"]),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args, words, capsys):
    assert run_cli(args) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_hooks_route_missing_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.delattr(actcore, "Controller", raising=False)
    assert run_cli(["bench", "memory", *TINY, "--route", "hooks", "--levels", "G3"]) == 2
    assert HOOKS_UNAVAILABLE in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(actcore, "Controller"), reason="no hooks route in this version")
def test_unknown_hooks_level_lists_the_hooks_levels(capsys):
    from actcore.policies import HOOK_LEVELS

    assert run_cli(["bench", "memory", *TINY, "--route", "hooks", "--levels", "L3.1"]) == 2
    err = capsys.readouterr().err
    assert "'L3.1'" in err and "--route hooks" in err
    for level in ["fp", *HOOK_LEVELS]:
        assert level in err


def test_the_console_script_exits_2_on_a_bad_level():
    proc = subprocess.run(
        [sys.executable, "-m", "actcore.cli", "bench", "accuracy", "--levels", "L42"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "'L42'" in proc.stderr and "L3" in proc.stderr


# --------------------------------------------------------------------------------------------
# JSON results of tiny runs
# --------------------------------------------------------------------------------------------


def test_memory_json_schema_and_ratios(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert run_cli(["bench", "memory", *TINY, "--levels", "L0,L3", "--json", str(out)]) == 0
    data = load(out)
    assert data["benchmark"] == "memory" and data["partial"] is False
    assert data["torch"] == torch.__version__
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert dt.datetime.fromisoformat(data["date"]).tzinfo is not None
    assert data["command"].startswith("actcore ")
    rows = data["rows"]
    assert [r["level"] for r in rows] == ["fp", "L0", "L3"]  # fp first: the reference
    fp = rows[0]["retained_bytes"]
    for row in rows:
        assert isinstance(row["retained_bytes"], int) and row["retained_bytes"] > 0
        assert row["ratio"] == pytest.approx(fp / row["retained_bytes"])
        assert row["step_time_s"] > 0
        assert row["throughput"] == pytest.approx(4 / row["step_time_s"])
        assert row["gpu_peak_bytes"] is None  # CPU run
        assert row["device_bytes"] == row["retained_bytes"]  # all of it in host memory
    held = [r["retained_bytes"] for r in rows]
    assert held[2] < held[1] < held[0]  # each level keeps less for backward
    assert rows[2]["ratio"] > 4
    # one step's ATen calls against fp's (L0 saves masks compactly: more calls), no host
    # syncs in any; L3's few steps come before its first replan: statistics steps, named so
    assert all(r["aten_calls"] > 0 and r["sync_calls"] == 0 for r in rows)
    assert [r["aten_step"] for r in rows] == ["steady", "steady", "statistics"]
    assert rows[0]["aten_ratio"] == 1.0
    assert rows[2]["aten_calls"] > rows[0]["aten_calls"]
    assert rows[2]["aten_ratio"] == pytest.approx(rows[2]["aten_calls"] / rows[0]["aten_calls"])
    table = capsys.readouterr().out
    assert "held for backward" in table and "L3" in table and "ATen" in table


def test_memory_fp_row_matches_an_independent_count():
    rows: list[dict] = []
    cfg = memory.MemoryConfig(model="tiny-cnn", batch=3, levels=["fp"], steps=1, device="cpu")
    memory.run(cfg, rows)
    torch.manual_seed(0)
    model, shape, _ = memory.build_model("tiny-cnn")
    _, rep = actcore.memory.measure(model, torch.randn(3, *shape))
    assert rows[0]["retained_bytes"] == rep.retained_bytes


def test_accuracy_json_schema_and_statistics(tmp_path):
    out = tmp_path / "acc.json"
    args = ["bench", "accuracy", "--levels", "fp,L3", "--seeds", "2", "--epochs", "1"]
    assert run_cli([*args, "--quiet", "--json", str(out)]) == 0
    data = load(out)
    assert data["benchmark"] == "accuracy" and data["config"]["epochs"] == 1
    rows = data["rows"]
    assert [r["level"] for r in rows] == ["fp", "L3"]
    for row in rows:
        accs = row["accuracies"]
        assert len(accs) == 2 and row["seeds"] == [0, 1]
        assert row["accuracy_mean"] == pytest.approx(statistics.fmean(accs))
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(accs))
        assert all(0.5 < a <= 1.0 for a in accs)  # one epoch already learns digits (chance 0.1)
    assert rows[1]["delta_points"] == pytest.approx(
        100 * (rows[1]["accuracy_mean"] - rows[0]["accuracy_mean"])
    )


def test_digits_split_is_fixed_and_disjoint():
    a, b = accuracy.load_task("digits"), accuracy.load_task("digits")
    assert torch.equal(a.x_test, b.x_test) and len(a.y_test) == 450 and len(a.y_train) == 1347
    train = {tuple(x.flatten().tolist()) for x in a.x_train}
    overlap = sum(tuple(x.flatten().tolist()) in train for x in a.x_test)
    assert overlap < 10  # digits has a few duplicate images, not a leaked split


# --------------------------------------------------------------------------------------------
# end-to-end runs of each CPU subcommand
# --------------------------------------------------------------------------------------------

DEMO_TINY = ["--model", "tiny-cnn", "--batch", "2", "--levels", "L3", "--epochs", "1"]


@pytest.mark.parametrize("command", [["demo"], ["bench"]])
def test_demo_and_bare_bench_print_the_summary(command, tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert run_cli([*command, *DEMO_TINY, "--quiet", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Memory: at L3, tiny-cnn holds" in text
    assert "Accuracy: digits test accuracy" in text and "without ACT" in text
    rows = load(out)["rows"]
    assert {r["benchmark"] for r in rows} == {"memory", "accuracy"}
    assert [r["level"] for r in rows if r["benchmark"] == "accuracy"] == ["fp", "L3"]


def test_sweep_writes_rows_and_a_png(tmp_path):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    args = ["bench", "sweep", "--model", "tiny-cnn", "--levels", "fp,L3", "--batches", "4,2"]
    assert run_cli([*args, "--steps", "1", "--quiet", "--png", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = load(out)["rows"]
    assert [(r["level"], r["batch"]) for r in rows] == [("fp", 2), ("fp", 4), ("L3", 2), ("L3", 4)]
    assert all(not r["oom"] and r["throughput"] > 0 for r in rows)


def test_sweep_plot_marks_out_of_memory_with_a_red_cross():
    rows = [
        {"level": "fp", "batch": 2, "oom": False, "throughput": 10.0},
        {"level": "fp", "batch": 4, "oom": True},
        {"level": "L3", "batch": 2, "oom": False, "throughput": 8.0},
        {"level": "L3", "batch": 4, "oom": False, "throughput": 9.0},
    ]
    fig = sweep.figure(sweep.SweepConfig(model="tiny-cnn"), rows)
    crosses = [
        line
        for line in fig.axes[0].get_lines()
        if line.get_marker() == "x" and line.get_color() == "red"
    ]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [4]


@pytest.mark.parametrize("command", ["max-batch", "kernels"])
def test_gpu_benchmarks_on_cpu_give_a_clear_message(command, capsys):
    assert run_cli(["bench", command, "--device", "cpu", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"actcore bench {command} needs a CUDA GPU" in err


@pytest.mark.skipif(not hasattr(actcore, "Controller"), reason="no hooks route in this version")
def test_memory_through_the_hooks_route(tmp_path):
    out = tmp_path / "hooks.json"
    assert run_cli(["bench", "memory", *TINY, "--route", "hooks", "--levels", "G3"]) == 0
    assert run_cli(["bench", "memory", *TINY, "--route", "hooks", "--json", str(out)]) == 0
    rows = load(out)["rows"]
    assert all(r["route"] == "hooks" for r in rows)
    assert rows[-1]["retained_bytes"] < rows[0]["retained_bytes"]


# --------------------------------------------------------------------------------------------
# Ctrl-C keeps the partial results
# --------------------------------------------------------------------------------------------


def test_ctrl_c_in_memory_keeps_the_levels_measured(tmp_path, monkeypatch):
    real = memory.measure_level
    calls = []

    def interrupted_after_one(cfg, level, device):
        calls.append(level)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(cfg, level, device)

    monkeypatch.setattr(memory, "measure_level", interrupted_after_one)
    out = tmp_path / "partial.json"
    args = ["bench", "memory", *TINY, "--levels", "L0,L3", "--json", str(out)]
    assert run_cli(args) == report.EXIT_INTERRUPTED == 130
    data = load(out)
    assert data["partial"] is True
    assert [r["level"] for r in data["rows"]] == ["fp"] and data["rows"][0]["retained_bytes"] > 0


def test_ctrl_c_in_accuracy_keeps_finished_seeds(tmp_path, monkeypatch):
    seeds_done = []

    def fake_train(cfg, split, level, seed):
        if level == "L3" and seed == 1:
            raise KeyboardInterrupt
        seeds_done.append((level, seed))
        return 0.9 + 0.01 * seed

    monkeypatch.setattr(accuracy, "train_once", fake_train)
    out = tmp_path / "partial.json"
    args = ["bench", "accuracy", "--levels", "fp,L3", "--seeds", "3", "--quiet"]
    assert run_cli([*args, "--json", str(out)]) == 130
    data = load(out)
    assert data["partial"] is True
    fp, l3 = data["rows"]
    assert fp["accuracies"] == pytest.approx([0.9, 0.91, 0.92]) and "partial" not in fp
    assert l3["partial"] is True and l3["seeds"] == [0] and l3["accuracies"] == [0.9]
    assert seeds_done == [("fp", 0), ("fp", 1), ("fp", 2), ("L3", 0)]


# --------------------------------------------------------------------------------------------
# the native subcommand is optional
# --------------------------------------------------------------------------------------------


def _commands(parser) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def test_native_subcommand_is_skipped_when_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "actcore.native.cli", None)
    commands = _commands(cli.build_parser())
    assert {"demo", "bench"} <= commands and "native" not in commands
    assert capsys.readouterr().err == ""  # a plain absence is silent


def test_native_subcommand_is_registered_when_present():
    pytest.importorskip("actcore.native.cli")
    assert "native" in _commands(cli.build_parser())


def test_threads_option_is_restored_after_the_command(monkeypatch):
    seen = []
    monkeypatch.setattr(
        "actcore.bench.kernels.main", lambda args: seen.append(torch.get_num_threads()) or 0
    )
    torch.set_num_threads(2)
    assert run_cli(["bench", "kernels", "--threads", "1"]) == 0
    assert seen == [1] and torch.get_num_threads() == 2


# --------------------------------------------------------------------------------------------
# output paths: checked before the run, written atomically
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["--json", "--png"])
def test_unwritable_output_is_refused_before_the_run(option, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before its output path was checked")

    monkeypatch.setattr(memory, "measure_level", must_not_run)
    monkeypatch.setattr(sweep, "run", must_not_run)
    command = ["bench", "memory", *TINY] if option == "--json" else ["bench", "sweep", "--quiet"]
    for bad in (blocker / "out.file", tmp_path):  # parent is a file; a directory
        assert run_cli([*command, option, str(bad)]) == 2
        err = capsys.readouterr().err
        assert option in err and str(bad) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing stray


def test_write_json_is_atomic_and_leaves_no_temporary(tmp_path, monkeypatch):
    import os

    out = tmp_path / "r.json"
    out.write_text('{"old": true}')

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        report.write_json(out, {"rows": [1]})
    assert json.loads(out.read_text()) == {"old": True}  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no stray temporary
    monkeypatch.undo()
    report.write_json(out, {"rows": [1]})
    assert json.loads(out.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


# --------------------------------------------------------------------------------------------
# rich and matplotlib: the `cli` extra, needed by the command line only
# --------------------------------------------------------------------------------------------

RICH = ("rich", "rich.console", "rich.table", "rich.progress")


def test_missing_rich_names_the_cli_extra(monkeypatch, capsys):
    for name in RICH:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    with pytest.raises(report.MissingExtra, match=r"pip install 'actcore\[cli\]'"):
        report.console()
    assert run_cli(["bench", "memory", *TINY, "--levels", "L3"]) == 1
    assert "pip install 'actcore[cli]'" in capsys.readouterr().err


def test_png_without_matplotlib_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before matplotlib was checked")

    monkeypatch.setattr(sweep, "run", must_not_run)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert run_cli(["bench", "sweep", "--quiet", "--png", str(tmp_path / "s.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_the_library_needs_neither_rich_nor_matplotlib():
    """Every actcore module imports, and a model trains a step, with both blocked."""
    code = (
        "import sys, importlib, pkgutil\n"
        "for name in ('rich', 'matplotlib'):\n"
        "    sys.modules[name] = None\n"
        "import torch, actcore\n"
        "for info in pkgutil.walk_packages(actcore.__path__, prefix='actcore.'):\n"
        "    if not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "model = actcore.convert(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))\n"
        "model(torch.randn(4, 8, requires_grad=True)).sum().backward()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
