"""Resume: 20 steps, save, load in a fresh process, 20 more == 40 uninterrupted, bitwise.

Every level of both routes (``convert`` and ``Controller``), with dropout, an adaptive plan
that is recomputed in both halves, and a per-model stream of rounding seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actcore
from actcore.config import LEVELS
from actcore.policies import HOOK_LEVELS

CASES = [("layers", lv) for lv in LEVELS] + [("hooks", lv) for lv in HOOK_LEVELS]
HALF = 20


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.LayerNorm(64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 4),
    )


def _build(route: str, level: str, seed: int = 123):
    model = _net()
    if route == "layers":
        actcore.convert(model, level, seed=seed)
        if getattr(model, "act_adaptive", None) is not None:
            model.act_adaptive.interval = 6  # replans in both halves
        act = None
    else:
        auto = HOOK_LEVELS[level].auto
        act = actcore.Controller(
            model, level, seed=seed, **({"adapt_interval": 6, "max_passes": 2} if auto else {})
        )
        act.install_hook()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, act, opt


def _steps(model, act, opt, first: int, count: int) -> None:
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 4, (32,), generator=g)

        def backprop(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        backprop()
        if act is not None:
            act.iterate(backprop)
        opt.step()


def _act_state(model, act) -> dict:
    return act.state_dict() if act is not None else actcore.resume.state_dict(model)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _save_half(route: str, level: str, path: Path) -> None:
    model, act, opt = _build(route, level)
    try:
        _steps(model, act, opt, 0, HALF)
    finally:
        if act is not None:
            act.uninstall_hook()  # its hooks must not outlive this case
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "act": _act_state(model, act),
            "torch_rng": torch.get_rng_state(),
        },
        path,
    )


def _continue(directory: str) -> None:
    """In the fresh process: every case's checkpoint, loaded, trained HALF more steps."""
    torch.set_num_threads(1)
    for route, level in CASES:
        ckpt = torch.load(Path(directory) / f"{route}-{level}.pt", weights_only=False)
        model, act, opt = _build(route, level, seed=999)  # the state brings the seed back
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        if act is not None:
            act.load_state_dict(ckpt["act"])
        else:
            actcore.resume.load_state_dict(model, ckpt["act"])
        torch.set_rng_state(ckpt["torch_rng"])
        _steps(model, act, opt, HALF, HALF)
        torch.save(_params(model), Path(directory) / f"{route}-{level}.done.pt")


def test_resume_in_a_fresh_process_is_bitwise_identical(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = {}
        for route, level in CASES:
            _save_half(route, level, tmp_path / f"{route}-{level}.pt")
            model, act, opt = _build(route, level)
            try:
                _steps(model, act, opt, 0, 2 * HALF)
            finally:
                if act is not None:
                    act.uninstall_hook()
            full[route, level] = _params(model)
    finally:
        torch.set_num_threads(threads)
    here = str(Path(__file__).parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import test_resume as t; t._continue({str(tmp_path)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for route, level in CASES:
        resumed = torch.load(tmp_path / f"{route}-{level}.done.pt")
        same = all(torch.equal(a, b) for a, b in zip(full[route, level], resumed, strict=True))
        assert same, f"{route} {level}: the resumed run differs from the uninterrupted one"


def test_kept_channel_scales_are_in_the_state_and_checked() -> None:
    """Both routes' states carry the channel scales kept between refreshes (a resumed run
    reuses them as the uninterrupted one does); a bad part is refused before any change."""
    for route, level in (("layers", "L3"), ("hooks", "G2")):
        model, act, opt = _build(route, level)
        try:
            _steps(model, act, opt, 0, 3)
        finally:
            if act is not None:
                act.uninstall_hook()
        state = _act_state(model, act)
        scales = state["channel_scales"]
        assert scales, route
        entries = list(scales.values())
        if route == "layers":
            entries = [e for table in entries for e in table.values()]
        found = [e for e in entries if e["exponents"] is not None]  # (some never packed)
        assert found and all(e["exponents"].dtype == torch.int8 for e in found)
        assert any(e["uses"] >= 1 for e in entries)  # (a norm's refresh count; a conv's: 0)
        bad = dict(state, channel_scales={"no.such.site": {"uses": -1}})
        if route == "layers":
            bad["channel_scales"] = {"no_such_module": {}}
            with pytest.raises(KeyError, match="no_such_module"):
                actcore.resume.load_state_dict(model, bad)
        else:
            with pytest.raises(ValueError, match="ChannelScales state"):
                act.load_state_dict(bad)
            assert act.saved_tensor_hooks.scales_state().keys() == scales.keys()  # unchanged


def test_seed_streams_are_per_model_threads_and_history_do_not_matter() -> None:
    """Two models trained in two threads reproduce a sequential run, whatever ran before.

    (Models are built in the main thread and have no dropout: torch's own generator is
    process-wide; the rounding noise is what this is about.)
    """

    def build(seed: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
        actcore.convert(model, "L3", seed=seed)
        model.act_adaptive.interval = 2
        return model, None, torch.optim.SGD(model.parameters(), lr=0.05)

    def run(results: dict, key: str, built, noise_before: bool) -> None:
        if noise_before:  # other quantization first: must not shift this model's noise
            actcore.ops.quantize(torch.randn(4, 256), 2)
        _steps(*built, 0, 5)
        results[key] = _params(built[0])

    sequential: dict = {}
    run(sequential, "a", build(1), False)
    run(sequential, "b", build(2), False)
    threaded: dict = {}
    workers = [
        threading.Thread(target=run, args=(threaded, "a", build(1), True)),
        threading.Thread(target=run, args=(threaded, "b", build(2), True)),
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for key in "ab":
        assert all(torch.equal(x, y) for x, y in zip(sequential[key], threaded[key], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(sequential["a"], sequential["b"], strict=True))


def test_default_seed_reads_torch_generator_without_drawing() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = actcore.rng.SeedStream()
    assert torch.equal(before, torch.get_rng_state())
    torch.manual_seed(5)
    assert actcore.rng.SeedStream().seed == a.seed
    with pytest.raises(ValueError, match="seed must be in"):
        actcore.rng.SeedStream(-1)
