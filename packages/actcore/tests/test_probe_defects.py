"""Defects of the second probe round (the reliability issue), each with its test."""

from __future__ import annotations

import json
import math
import os
import stat
import warnings

import pytest
import torch
from torch import nn

import actcore
from actcore.bench import report
from actcore.policies.sensitivity import ACGC


def test_the_default_level_trains_a_float64_model() -> None:
    """Item 1: adaptive bits' gradient statistics took a float32 norm of a float64
    gradient (torch refuses a lower ``dtype``); a double model now trains at L3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
    model = actcore.convert(model.double(), "L3")
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    for _ in range(3):
        model.zero_grad()
        model(x).square().mean().backward()
    assert all(
        p.grad.dtype == torch.float64 and p.grad.isfinite().all() for p in model.parameters()
    )


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_an_empty_batch_through_a_converted_batch_norm(level: str) -> None:
    """Item 4: a detection head with no proposals sends an empty batch; torch returns an
    empty output in eval and training, so does the converted batch norm."""
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU())
    model = actcore.convert(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU()), level)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(0, 3, 5, 5, requires_grad=True)
    out = model(x)
    assert out.shape == plain(x).shape == (0, 4, 5, 5)
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), -1.0, 0.0, True])
def test_acgc_error_bound_must_be_a_finite_positive_number(bound: float) -> None:
    """Item 7: NaN and inf were accepted (NaN then planned the minimum bits everywhere)."""
    with pytest.raises(ValueError, match="error_bound must be a finite positive number"):
        ACGC(error_bound=bound)


def test_an_atomic_json_write_keeps_the_files_permissions(tmp_path) -> None:
    """Item 8: the write went through ``mkstemp``'s 0600 file, so overwriting a 0644
    results file left it 0600; a new file gets the umask's mode as ``open`` gives it."""
    path = tmp_path / "results.json"
    path.write_text("{}")
    path.chmod(0o644)
    report.write_json(path, {"a": 1})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 and json.loads(path.read_text()) == {"a": 1}
    fresh = tmp_path / "fresh.json"
    umask = os.umask(0o022)
    try:
        report.write_json(fresh, {"b": math.pi})
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o644


def test_both_routes_refuse_a_non_finite_error_bound() -> None:
    with pytest.raises(ValueError, match="finite positive number, got nan"):
        actcore.Controller(nn.Linear(4, 4), "G2", policy="acgc", error_bound=float("nan"))
    with pytest.raises(ValueError, match="finite positive number, got inf"):
        actcore.convert(nn.Linear(4, 4), policy="acgc", error_bound=float("inf"))


# ---------------------------------------------------------------- 6: exclude by any name
class _Aliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.alias = self.a  # the same module under a second name
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.alias(x))


def test_exclude_by_an_alias_leaves_the_module() -> None:
    model = _Aliased()
    actcore.convert(model, exclude=["alias"])
    assert type(model.a) is nn.Linear and model.alias is model.a
    assert type(model.b) is not nn.Linear  # converted
    assert model.act_report.left == {"a": "excluded (as alias)"}


def test_an_exclude_pattern_that_matches_nothing_warns() -> None:
    with pytest.warns(UserWarning, match=r"exclude pattern 'nope\*' matches no module"):
        actcore.convert(_Aliased(), exclude=["nope*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actcore.convert(_Aliased(), exclude=["b", nn.Linear])  # each matches: no warning


# ---------------------------------------------------------------- 10: one in-place rule
_LAYERS = {
    "linear": (lambda c: nn.Linear(c, 8), lambda n, c: (n, c)),
    "conv": (lambda c: nn.Conv2d(c, 4, 3), lambda n, c: (n, c, 6, 6)),
    "batch_norm": (lambda c: nn.BatchNorm2d(c), lambda n, c: (n, c, 6, 6)),
    "layer_norm": (lambda c: nn.LayerNorm(c), lambda n, c: (n, c)),
    "gelu": (lambda c: nn.Sequential(nn.Linear(c, c), nn.GELU(), nn.Linear(c, 2)), None),
}


@pytest.mark.parametrize("level", ["L2", "L3"])
@pytest.mark.parametrize("kind", sorted(_LAYERS))
@pytest.mark.parametrize("numel", [96, 8192], ids=["small", "large"])
def test_an_inplace_change_of_a_saved_input_raises_at_every_size(
    level: str, kind: str, numel: int
) -> None:
    torch.manual_seed(0)
    make, shape = _LAYERS[kind]
    channels = 16 if kind != "gelu" else 32
    model = actcore.convert(nn.Sequential(make(channels)), level=level)
    if kind == "gelu":  # the GELU's input: the first linear's output
        x = torch.randn(numel // channels, channels, requires_grad=True)
        hidden = model[0][0](x)
        out = model[0][2](model[0][1](hidden))
        changed = hidden
    else:
        dims = shape(1, channels)
        per_sample = math.prod(dims)
        x = torch.randn(shape(max(1, numel // per_sample), channels), requires_grad=True)
        changed = x.clone()
        out = model(changed)
    with torch.no_grad():
        changed.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("level", ["L2", "L3"])
def test_no_inplace_change_no_error_and_a_freed_input_is_fine(level: str) -> None:
    torch.manual_seed(0)
    model = actcore.convert(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True)), level=level
    )
    model(torch.randn(4, 3, 20, 20)).sum().backward()  # input freed after the forward
    x = torch.randn(4, 3, 20, 20, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


# ---------------------------------------------------------------- 11: a forward that raises
class _Fails(nn.Module):
    """Conv, BN, ReLU, then a linear; raises after the convolutional part when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 14 * 14, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        if self.fail:
            raise ValueError("a bad batch")
        return self.head(h.flatten(1))


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_forward_that_raises_takes_no_seeds_and_no_statistics() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    clean, failing = _Fails(), _Fails()
    failing.load_state_dict(clean.state_dict())
    actcore.convert(clean, level="L3", seed=7)
    actcore.convert(failing, level="L3", seed=7)
    _step(clean, x), _step(failing, x)
    stats = failing.act_adaptive.layers
    before = {
        n: (s.profile.clone(), s.elems.clone()) for n, s in stats.items() if s.profile is not None
    }
    count = failing.act_rng.count
    assert before and count > 0
    failing.fail = True
    with pytest.raises(ValueError, match="a bad batch"):
        failing(x)
    failing.fail = False
    assert failing.act_rng.count == count
    for name, (profile, elems) in before.items():
        assert torch.equal(stats[name].profile, profile) and torch.equal(stats[name].elems, elems)
    # the next step is the one the model without the failure takes, bit for bit
    for a, b in zip(_step(clean, x), _step(failing, x), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- 5: another model's plan
def _trained_l3(model: nn.Module, x: torch.Tensor) -> nn.Module:
    actcore.convert(model, level="L3", seed=1)
    for _ in range(2):
        model(x).square().sum().backward()
    return model


def test_another_models_adaptive_state_is_refused_and_changes_nothing() -> None:
    torch.manual_seed(0)
    mlp = _trained_l3(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(16, 64)
    )
    cnn = _trained_l3(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)),
        torch.randn(16, 3, 16, 16),
    )
    before = actcore.resume.state_dict(cnn)
    with pytest.raises(ValueError, match="taken on other layers"):
        actcore.resume.load_state_dict(cnn, actcore.resume.state_dict(mlp))
    with pytest.raises(ValueError, match="taken on other layers"):
        cnn.act_adaptive.load_state_dict(mlp.act_adaptive.state_dict())
    after = actcore.resume.state_dict(cnn)
    assert after["rng"] == before["rng"]
    for name, entry in before["adaptive"]["layers"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["adaptive"]["layers"][name][key], value), (name, key)


def test_same_names_other_shapes_is_refused() -> None:
    torch.manual_seed(0)
    narrow = _trained_l3(
        nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(16, 64)
    )
    wide = _trained_l3(
        nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 4)), torch.randn(16, 64)
    )
    with pytest.raises(ValueError, match="weight shapes"):
        wide.act_adaptive.load_state_dict(narrow.act_adaptive.state_dict())
    twin = _trained_l3(
        nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(16, 64)
    )
    twin.act_adaptive.load_state_dict(narrow.act_adaptive.state_dict())  # the same layers


def _estimated_controller(model: nn.Module, x: torch.Tensor) -> actcore.Controller:
    controller = actcore.Controller(model, "G2", policy="acgc", error_bound=0.1)

    def backprop() -> None:
        with controller:
            model(x).square().sum().backward()

    controller.iterate(backprop)
    return controller


def test_a_policy_state_of_another_model_is_refused() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4))
    from_mlp = _estimated_controller(mlp, torch.randn(16, 64)).state_dict()
    assert from_mlp["modules"]  # the plan names modules of the MLP
    target = _estimated_controller(cnn, torch.randn(16, 3, 16, 16))
    before = target.state_dict()
    with pytest.raises(ValueError, match="taken on another model"):
        target.load_state_dict(from_mlp)
    assert target.state_dict()["policy"]["plan"] == before["policy"]["plan"]
    twin = _estimated_controller(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), torch.randn(16, 64)
    )
    twin.load_state_dict(from_mlp)  # the same modules: loads

    # the layer route: convert(policy="acgc") keeps the same check
    scheme_mlp = actcore.convert(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), "L2", policy="acgc"
    ).act_policy
    scheme_cnn = actcore.convert(
        nn.Sequential(nn.Conv2d(3, 64, 3), nn.ReLU(), nn.Conv2d(64, 4, 3)), "L2", policy="acgc"
    ).act_policy
    state = scheme_mlp.state_dict()
    state["policy"]["plan"] = {"0:conv": 4, "2:conv": 4}
    state["policy"]["numel"] = {"0:conv": 1024, "2:conv": 1024}
    state["modules"] = actcore.policies.plan_modules(scheme_mlp.model, state["policy"])
    with pytest.raises(ValueError, match="taken on another model"):
        scheme_cnn.load_state_dict(state)


# ---------------------------------------------------------------- 2: torch.export
def _export_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)
    )


def _adaptive_values(model: nn.Module) -> dict[str, list]:
    return {
        name: [t.clone() for t in (s.elems, s.profile, s.sens) if t is not None]
        for name, s in model.act_adaptive.layers.items()
    }


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_export_of_an_l3_model_works_in_eval_and_changes_no_state(trained: bool) -> None:
    torch.manual_seed(0)
    model = actcore.convert(_export_model(), level="L3")
    x = torch.randn(4, 3, 16, 16)
    if trained:
        model(x).sum().backward()
    before = _adaptive_values(model)
    rng = dict(model.act_rng.state_dict())
    model.eval()
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        assert torch.equal(program.module()(x), model(x))
    after = _adaptive_values(model)
    assert before.keys() == after.keys()
    for name in before:
        assert len(before[name]) == len(after[name])
        assert all(torch.equal(a, b) for a, b in zip(before[name], after[name], strict=True))
    assert model.act_rng.state_dict()["seed"] == rng["seed"]
    actcore.resume.state_dict(model)  # still readable
    model.train()
    model(x).sum().backward()  # and it trains on


# ---------------------------------------------------------------- 3: torch.func transforms
def _transform_runs(model: nn.Module, params: dict, x: torch.Tensor) -> dict:
    from torch.func import functional_call, grad, jacrev, vmap

    def loss(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).sum()

    return {
        "grad": lambda: grad(loss)(params, x),
        "vmap_grad": lambda: vmap(grad(loss), in_dims=(None, 0))(params, x[:, None]),
        "jacrev": lambda: jacrev(lambda x: functional_call(model, params, (x,)))(x),
    }


def _probe_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.LayerNorm(8), nn.Linear(8, 1)
    )


@pytest.mark.parametrize("level", ["L2", "L3"])
@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jacrev"])
def test_torch_func_transforms_get_a_clear_error(level: str, transform: str) -> None:
    model = actcore.convert(_probe_net().eval(), level)
    params = dict(model.named_parameters())
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"cannot run under torch\.func transforms"):
        _transform_runs(model, params, x)[transform]()
    # a Q-layer used on its own (no converted root) says the same
    layer = actcore.QLinear(4, 4)
    layer.act_level = level
    from torch.func import functional_call, grad

    with pytest.raises(RuntimeError, match=r"QLinear at L\d cannot run under torch\.func"):
        grad(lambda p: functional_call(layer, p, (x,)).sum())(dict(layer.named_parameters()))
    # the unconverted twin takes the same parameters: the way out the error names
    grads = _transform_runs(_probe_net().eval(), params, x)["grad"]()
    assert set(grads) == set(params)


@pytest.mark.parametrize("transform", ["grad", "vmap_grad", "jacrev"])
def test_torch_func_transforms_run_at_l0_as_plain_pytorch(transform: str) -> None:
    """L0 promises plain PyTorch: its layers (the masked and pooling ones too) run torch's
    own forward under a transform, and the results are bitwise the plain model's."""
    torch.manual_seed(0)
    plain = _probe_net().eval()
    model = actcore.convert(plain, "L0")
    params = dict(model.named_parameters())
    x = torch.randn(3, 4)
    got = _transform_runs(model, params, x)[transform]()
    want = _transform_runs(plain, params, x)[transform]()
    if isinstance(want, dict):
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        assert torch.equal(got, want)


def test_torch_func_grad_of_a_converted_cnn_at_l0() -> None:
    """Convolutions, batch norm (train mode), max pooling and ReLU at L0 under
    ``torch.func.grad``: bitwise the plain model's gradients."""
    from torch.func import functional_call, grad

    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 2),
    )
    model = actcore.convert(plain, "L0")
    assert isinstance(model[0], actcore.QConv2d) and isinstance(model[3], actcore.QMaxPool2d)
    params = dict(model.named_parameters())
    x = torch.randn(2, 3, 12, 12)

    def run(net: nn.Module) -> dict:
        buffers = {k: b.clone() for k, b in net.named_buffers()}  # train mode updates them
        return grad(lambda p, b: functional_call(net, (p, b), (x,)).sum())(params, buffers)

    got, want = run(model), run(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
