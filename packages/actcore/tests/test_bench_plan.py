"""``actcore bench plan``: one row per budget with what the plan keeps (within the budget),
its step time and its gradient cosine against the unconverted model (1 for the exact plan),
ending where no plan fits; with ``--compiled``, rows of torch.compile's
activation_memory_budget beside them; bad options refused."""

from __future__ import annotations

import json

from conftest import run_cli


def test_bench_plan_rows_from_exact_to_nothing_fits(tmp_path):
    out = tmp_path / "plan.json"
    args = ["bench", "plan", "--model", "tiny-cnn", "--batch", "2", "--budgets", "3"]
    args += ["--below", "2", "--steps", "1", "--quiet", "--threads", "1", "--json", str(out)]
    args += ["--compiled", "0.1"]
    assert run_cli(args) == 0
    rows = json.loads(out.read_text())["rows"]
    (compiled,) = [r for r in rows if "compiled" in r]  # PyTorch's knapsack, after the plans
    rows = rows[: rows.index(compiled)]
    planned = [r for r in rows if "error" not in r]
    assert len(planned) == 3
    assert planned[0]["levels"] == "8 L0" and planned[0]["grad_cosine"] > 0.99999
    for row in planned:
        assert row["kept_bytes"] <= row["budget"]
        assert 0.9 < row["grad_cosine"] <= 1.0 + 1e-6 and row["step_ms"] > 0
    assert [r["budget"] for r in planned] == sorted((r["budget"] for r in planned), reverse=True)
    assert "no plan" not in json.dumps(planned)
    assert rows[-1].get("error", "").startswith("a budget of")  # tiny-cnn has no blocks
    # activation_memory_budget=0.1 recomputes: it keeps less than exact, gradients exact
    assert compiled["compiled"] == 0.1 and 0 < compiled["kept_bytes"] < planned[0]["kept_bytes"]
    assert compiled["grad_cosine"] > 0.9999 and compiled["step_ms"] > 0


def test_bench_plan_refuses_bad_options(capsys):
    assert run_cli(["bench", "plan", "--model", "resnet5"]) == 2
    assert run_cli(["bench", "plan", "--model", "tiny-cnn", "--below", "-1"]) == 2
    assert "--below" in capsys.readouterr().err
    for bad in ("0", "1.5", "half", ""):
        assert run_cli(["bench", "plan", "--model", "tiny-cnn", "--compiled", bad]) == 2
        assert "--compiled" in capsys.readouterr().err


def test_bench_plan_time_order_beside_checkpointing_alone_with_its_frontier_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    args = ["bench", "plan", "--model", "resnet18", "--batch", "2", "--image-size", "32"]
    args += ["--budgets", "3", "--below", "1", "--steps", "1", "--order", "time", "--quiet"]
    args += ["--threads", "1", "--json", str(out), "--png", str(png)]
    assert run_cli(args) == 0
    rows = json.loads(out.read_text())["rows"]
    planned = [r for r in rows if "error" not in r]
    assert len(planned) >= 3
    assert planned[0]["predicted_vs_exact"] is None  # exact: nothing was planned or timed
    for row in planned:
        assert row["order"] == "time" and row["kept_bytes"] <= row["budget"]
        assert row["scope_on"] is not None
        assert row is planned[0] or row["predicted_vs_exact"] >= 1.0
        if "ckpt_ms" in row:  # checkpointing alone fit this budget too
            assert row["ckpt_kept_bytes"] <= row["budget"] and row["vs_ckpt"] > 0
    assert planned[0]["ckpt_recomputed"] == 0  # the exact budget: nothing to recompute
    assert any("ckpt_ms" not in r for r in planned)  # all-L3 bytes: beyond checkpointing
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
