"""FewBit activations and policies through both front doors (convert and Controller)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import flat_grad, forward_backward
from torch import nn

import actcore
from actcore import fewbit, memory, ops
from actcore.fewbit.convert import SMOOTH_LEFT

SMOOTH = [
    nn.GELU(),
    nn.GELU(approximate="tanh"),
    nn.SiLU(),
    nn.Tanh(),
    nn.Sigmoid(),
    nn.ELU(alpha=0.7),
    nn.CELU(alpha=1.3),
    nn.SELU(),
    nn.Mish(),
    nn.Softplus(beta=2.0, threshold=5.0),
    nn.Hardswish(),
    nn.LogSigmoid(),
    nn.Softsign(),
    nn.Tanhshrink(),
]
PIECEWISE = [nn.Hardsigmoid(), nn.Threshold(0.1, -2.0), nn.Hardshrink(0.3), nn.Softshrink(0.4)]

TOKENS, HIDDEN, FFN = 8 * 128, 768, 3072


def _pair(act: nn.Module) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 64), act, nn.Linear(64, 4))
    return ref, copy.deepcopy(ref)


# --------------------------------------------------------------------------------------------
# The swap: forward bitwise, state_dict, report, errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act", SMOOTH + PIECEWISE, ids=lambda m: repr(m))
@pytest.mark.parametrize("route", ["convert", "controller"])
def test_swap_keeps_forward_bitwise_and_state_dict(act: nn.Module, route: str) -> None:
    ref, model = _pair(act)
    if route == "convert":
        actcore.convert(model, level="L0", fewbit_bits=2)
        assert model.act_report.converted["1"] == type(act).__name__
    else:
        ctl = actcore.Controller(model, level="G0", fewbit_bits=2)
        assert ctl.fewbit_swapped == {"1": type(act).__name__}
    swapped = model[1]
    assert isinstance(swapped, type(act)) and type(swapped).__module__ == fewbit.GELU.__module__
    smooth = any(type(act) is type(m) for m in SMOOTH)
    assert swapped.bits == (2 if smooth else 1)
    assert swapped.extra_repr().startswith(act.extra_repr())  # same constructor arguments
    assert ref.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3)) * 3
    out_ref, g_ref = forward_backward(ref, x)
    out, g = forward_backward(model, x)
    assert torch.equal(out, out_ref)
    for a, b in zip(g_ref, g, strict=True):
        assert torch.isfinite(b).all()
        if not smooth:  # two-valued derivatives are exact from the 1-bit mask
            assert torch.equal(a, b)
        else:  # a 2-bit derivative table: the gradient still points the same way
            assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.8


def test_convert_without_fewbit_bits_leaves_smooth_activations_with_reason() -> None:
    """Without few-bit codes, torch's smooth activations keep their class: the scope
    recomputes them from their compressed input (see test_scope); with layers only, they
    are left as they are, and the report says so."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.SiLU(), nn.Hardsigmoid())
    actcore.convert(model, level="L2")
    assert type(model[1]) is nn.GELU and type(model[2]) is nn.SiLU
    assert model.act_report.left == {}
    actcore.convert(model, level="L2", fewbit_bits=None, layers_only=True)
    assert type(model[1]) is nn.GELU and type(model[2]) is nn.SiLU
    assert model.act_report.left == {"1": SMOOTH_LEFT, "2": SMOOTH_LEFT}
    assert model.act_report.converted["3"] == "Hardsigmoid"  # exact 1-bit mask, always
    # converting again with bits swaps them; again without bits keeps them few-bit
    actcore.convert(model, level="L2", fewbit_bits=4)
    assert model[1].bits == 4 and model[2].bits == 4 and model.act_report.left == {}
    actcore.convert(model, level="L2", fewbit_bits=1)
    assert model[1].bits == 1
    actcore.convert(model, level="L2", fewbit_bits=None)
    assert isinstance(model[1], fewbit.GELU) and model[1].bits == 1
    # few-bit codes are opt-in: by default no level swaps a plain activation
    for level in ("L0", "L2", "L3"):
        fresh = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        actcore.convert(fresh, level=level)
        assert type(fresh[1]) is nn.GELU


def test_controller_without_fewbit_bits_leaves_model_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    ctl = actcore.Controller(model, level="G1")
    assert type(model[1]) is nn.GELU and ctl.fewbit_swapped == {}


def test_excluded_activation_is_not_swapped() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.GELU())
    actcore.convert(model, level="L0", fewbit_bits=3, exclude=("2",))
    assert isinstance(model[1], fewbit.GELU) and type(model[2]) is nn.GELU
    assert model.act_report.left == {"2": "excluded"}


@pytest.mark.parametrize("bad", [0, 5, 8])
def test_bad_fewbit_bits_raise_naming_value(bad: int) -> None:
    model = nn.Sequential(nn.GELU())
    with pytest.raises(ValueError, match=rf"1\.\.4, got {bad}"):
        actcore.convert(model, level="L0", fewbit_bits=bad)
    with pytest.raises(ValueError, match=rf"1\.\.4, got {bad}"):
        actcore.Controller(model, level="G1", fewbit_bits=bad)
    assert type(model[0]) is nn.GELU  # nothing half-done
    with pytest.raises(TypeError, match=r"2\.5"):
        actcore.convert(model, level="L0", fewbit_bits=2.5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Memory: BERT-shaped MLP block (768 -> 3072 -> 768, batch 8, seq 128, fp32), 3-bit GELU
# --------------------------------------------------------------------------------------------


def _bert_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, 3072), nn.GELU(), nn.Linear(FFN, HIDDEN))


def _apart_bytes(channels: int, rows: int, exact: bool) -> int:
    """What keeping outlier channels apart adds (ChannelScaled): an int8 scale exponent per
    channel and, where backward may be nonlinear in the tensor (``exact``), one channel per
    256 kept as it is (fp32 rows) with its int64 index."""
    kept = -(-channels // 256) if exact else 0
    return channels + kept * (rows * 4 + 8)


def _quantized_bytes(numel: int, bits: int, group: int = 256) -> int:
    """Codes at ``bits`` per element plus a bf16 minimum and a bf16 step per group."""
    assert numel % group == 0 and numel * bits % 8 == 0
    return numel * bits // 8 + (numel // group) * 2 * 2


def _retained(model: nn.Module, x: torch.Tensor, ctl: actcore.Controller | None = None) -> int:
    if ctl is not None:
        ctl.install_hook()
    try:
        with memory.track(model) as rep:
            out = model(x)
    finally:
        if ctl is not None:
            ctl.uninstall_hook()
    out.sum().backward()  # and it trains
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    return rep.retained_bytes


def test_bert_mlp_bytes_both_routes() -> None:
    """Full precision elsewhere (convert L0, Controller L0), so only the GELU changes."""
    x = torch.randn(8, 128, HIDDEN)
    n_in, n_mid = TOKENS * HIDDEN, TOKENS * FFN
    gelu_3bit = n_mid * 3 // 8  # the packed derivative index, no metadata
    fp32 = (n_in + 2 * n_mid) * 4  # x, GELU input, GELU output
    model = _bert_mlp()
    got = {
        "fp32": _retained(_bert_mlp(), x),
        "convert L0 + 3-bit GELU": _retained(actcore.convert(_bert_mlp(), "L0", fewbit_bits=3), x),
        "Controller L0 + 3-bit GELU": _retained(
            model, x, actcore.Controller(model, "G0", fewbit_bits=3)
        ),
    }
    expected = n_in * 4 + gelu_3bit + n_mid * 4
    for label, held in got.items():
        print(f"BERT MLP {label}: {held} B ({held / 2**20:.3f} MiB)")
    assert got == {
        "fp32": fp32,
        "convert L0 + 3-bit GELU": expected,
        "Controller L0 + 3-bit GELU": expected,
    }
    # the swap removes exactly the GELU input (fp32) and adds its 3-bit index
    assert fp32 - expected == n_mid * 4 - gelu_3bit == 11_403_264
    assert fp32 / expected > 1.67  # 27 MiB -> 16.1 MiB


@pytest.mark.parametrize("tokens", [16])
def test_mlp_bytes_with_quantized_linears_both_routes(tokens: int) -> None:
    """At 4-bit linear inputs (convert L1, Controller L1) the swap saves the GELU input's
    4-bit copy (codes + group metadata) and adds the 3-bit index; a short sequence keeps the
    pure-PyTorch quantizer fast, the arithmetic is the BERT block's per token."""
    x = torch.randn(1, tokens, HIDDEN)
    n_in, n_mid = tokens * HIDDEN, tokens * FFN
    gelu_3bit = n_mid * 3 // 8
    q_in, q_mid = _quantized_bytes(n_in, 4), _quantized_bytes(n_mid, 4)
    # linear inputs: outlier channels scaled apart; on the hooks route (and a recomputed
    # activation's input, which backward uses nonlinearly) also kept exact
    lin_in, lin_mid = (
        q_in + _apart_bytes(HIDDEN, tokens, False),
        q_mid + _apart_bytes(FFN, tokens, False),
    )
    hook_in, hook_mid = (
        q_in + _apart_bytes(HIDDEN, tokens, True),
        q_mid + _apart_bytes(FFN, tokens, True),
    )
    got = {}
    for fb in (None, 3):
        got[f"convert L1 fewbit={fb}"] = _retained(
            actcore.convert(_bert_mlp(), "L1", fewbit_bits=fb), x
        )
        got[f"convert L1 layers only fewbit={fb}"] = _retained(
            actcore.convert(_bert_mlp(), "L1", fewbit_bits=fb, layers_only=True), x
        )
        model = _bert_mlp()
        got[f"Controller L1 fewbit={fb}"] = _retained(
            model, x, actcore.Controller(model, "G1", fewbit_bits=fb)
        )
    assert got == {
        # convert keeps a plain GELU's input at 4 bits, its largest channels exact, and the
        # second linear refers to it (its input is the GELU's output, derived from that);
        # the Controller keeps both; with layers_only the GELU's input stays in fp32
        "convert L1 fewbit=None": lin_in + hook_mid,
        "convert L1 layers only fewbit=None": lin_in + n_mid * 4 + lin_mid,
        "Controller L1 fewbit=None": hook_in + hook_mid + hook_mid,
        "convert L1 fewbit=3": lin_in + gelu_3bit + lin_mid,
        "convert L1 layers only fewbit=3": lin_in + gelu_3bit + lin_mid,
        "Controller L1 fewbit=3": hook_in + gelu_3bit + hook_mid,
    }


def test_hooks_keep_the_fewbit_index_as_is_and_not_the_activation_input() -> None:
    model = _bert_mlp()
    ctl = actcore.Controller(model, "G1", fewbit_bits=3)
    seen: list[torch.Tensor] = []
    pack = ctl.saved_tensor_hooks.pack

    def spy(t: torch.Tensor):
        seen.append(t)
        return pack(t)

    ctl.saved_tensor_hooks.pack = spy  # type: ignore[method-assign]
    tokens = 16
    x = torch.randn(1, tokens, HIDDEN)
    with ctl:
        out = model(x)
    activations = [t for t in seen if not isinstance(t, nn.Parameter) and t.numel() >= 1024]
    shapes = {(t.dtype, t.numel()) for t in activations}
    # Linear 1's input, the GELU's packed index (uint8), Linear 2's input (the GELU output)
    assert (torch.uint8, tokens * FFN * 3 // 8) in shapes
    floats = [t for t in activations if t.is_floating_point() and t.numel() == tokens * FFN]
    assert len(floats) == 1  # only the GELU output: its input is not saved as well
    index = next(t for t in activations if t.dtype == torch.uint8)
    handle = ctl.saved_tensor_hooks.pack(index)
    assert handle.tensor is not None and handle.stored is None  # passed through untouched
    assert ctl.saved_tensor_hooks.unpack(handle) is not None and torch.equal(
        ctl.saved_tensor_hooks.unpack(handle), index
    )
    out.sum().backward()
    assert torch.isfinite(model[0].weight.grad).all()


def test_quantized_bytes_formula_matches_ops() -> None:
    for numel in (TOKENS * HIDDEN, TOKENS * FFN):
        p = ops.quantize(torch.randn(8, numel // 8), 4)
        assert p.nbytes == _quantized_bytes(numel, 4)


# --------------------------------------------------------------------------------------------
# Policies through convert (the same ACGC / AutoPrecision objects as Controller's)
# --------------------------------------------------------------------------------------------


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _cnn_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(16, 3, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g)


def _adapted(policy: str, **options) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = actcore.convert(_cnn(), level="L3", policy=policy, **options)
    x, y = _cnn_data()
    model.act_policy.iterate(lambda: flat_grad(model, x, y))
    return model, (x, y)


@pytest.mark.parametrize("bound", [0.1, 0.02])
def test_acgc_through_convert_keeps_gradient_error_under_bound(bound: float) -> None:
    model, (x, y) = _adapted("acgc", error_bound=bound)
    scheme = model.act_policy
    policy = scheme.policy
    assert isinstance(policy, actcore.policies.ACGC) and policy.estimates == 1
    assert (
        getattr(model, "act_adaptive", None) is None
    )  # the policy replaces L3's own adaptive bits
    # every conv / BN input has a measured key, and the plan compresses
    assert set(policy.plan) == {"0:conv", "1:norm", "3:conv", "4:norm"}
    assert policy.average_bits() < 32 and policy.predicted_error <= bound
    exact = flat_grad(actcore.convert(_cnn(), level="L0"), x, y)
    errors = torch.stack([(flat_grad(model, x, y) - exact).norm() / exact.norm() for _ in range(8)])
    rms = errors.square().mean().sqrt().item()
    assert rms <= bound, (rms, bound, policy.plan)


def test_acgc_through_convert_tighter_bound_more_bits() -> None:
    loose = _adapted("acgc", error_bound=0.3)[0].act_policy.policy.average_bits()
    tight = _adapted("acgc", error_bound=0.01)[0].act_policy.policy.average_bits()
    assert loose < tight


def test_policy_plan_state_dict_round_trip_and_same_bytes() -> None:
    model, (x, _) = _adapted("auto", avg_bits=3)
    state = model.act_policy.state_dict()
    plan = model.act_policy.bit_plan
    assert plan and state["iteration"] == 1
    resumed = actcore.convert(_cnn(), level="L3", policy="auto", avg_bits=3)
    assert resumed.act_policy.bit_plan == {}
    resumed.act_policy.load_state_dict(state)
    assert resumed.act_policy.bit_plan == plan and resumed.act_policy.iteration == 1
    assert resumed.act_policy.state_dict() == state
    for m in (model, resumed):
        m.act_policy.policy.adapt_interval = 10**6  # no re-estimate: use the plan as is
    with memory.track(model) as a:
        model(x)
    with memory.track(resumed) as b:
        resumed(x)
    assert a.retained_bytes == b.retained_bytes  # same plan, same compressed sizes
    with pytest.raises(ValueError, match="'acgc' policy given to 'auto'"):
        resumed.act_policy.load_state_dict({**state, "policy": {"name": "acgc"}})


def test_fixed_policy_through_convert_sets_bits_and_bad_policy_errors() -> None:
    x, _ = _cnn_data()
    sizes = {}
    for bits in (2, 8):
        model = actcore.convert(_cnn(), level="L2", policy="fixed", bits=bits)
        with memory.track(model) as rep:
            out = model(x)
        assert torch.equal(out, _cnn()(x))  # forward unchanged
        sizes[bits] = rep.retained_bytes
    assert sizes[2] < sizes[8]
    with pytest.raises(ValueError, match="unknown policy 'best'; valid: fixed, auto, acgc"):
        actcore.convert(_cnn(), level="L3", policy="best")
    with pytest.raises(TypeError, match="need a policy"):
        actcore.convert(_cnn(), level="L3", error_bound=0.1)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['avg_bits'\]"):
        actcore.convert(_cnn(), level="L3", policy="acgc", avg_bits=2)
    # converting again without a policy detaches it (L3's adaptive bits come back)
    model = actcore.convert(_cnn(), level="L3", policy="acgc")
    actcore.convert(model, level="L3")
    assert model.act_policy is None and model.act_adaptive is not None
    assert model[0].act_scheme is model.act_adaptive


def test_q_layers_inside_compressing_hooks_keep_their_own_packing():
    """Hooks pass through what a Q-layer saved: its packed data, weights, exact statistics.

    Without that, the hooks quantized again a Q-layer's packed metadata and normalization
    statistics (both above the hooks' size threshold here), corrupting its backward.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 1024, 1, bias=False), nn.BatchNorm2d(1024), nn.ReLU(), nn.Conv2d(1024, 4, 1)
    )
    x = torch.randn(4, 8, 16, 16)  # packed metadata of 4 x 1024 groups per tensor
    model(x).square().sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    actcore.convert(model, level="L2")
    with memory.track(model) as alone:
        out = model(x)
    del out
    with memory.track(model) as inside, actcore.compress_saved_tensors("G1.2"):
        out = model(x)
    assert inside.retained_bytes == alone.retained_bytes  # nothing packed a second time
    model.zero_grad()
    out.square().sum().backward()
    for p, g in zip(model.parameters(), exact, strict=True):
        cos = F.cosine_similarity(p.grad.flatten(), g.flatten(), dim=0)
        assert cos > 0.9, cos
