"""Controller: GACT's API over the saved-tensor hooks, levels, state round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cross_entropy_backprop, train_iterations
from torch import nn

import actcore
from actcore.controller import Controller
from actcore.policies import ACGC, HOOK_LEVELS, AutoPrecision, FixedBits


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4)
    )


def test_levels_map_to_policies() -> None:
    model = _mlp()
    expected = {"G0": None, "G1": 4, "G1.1": 8, "G1.2": 2}
    for name, bits in expected.items():
        policy = Controller(model, name).policy
        assert isinstance(policy, FixedBits) and policy.bits == bits
    for name, avg in {"G2": 4, "G2.1": 3, "G2.2": 2, "G3": 4}.items():
        policy = Controller(model, name).policy
        assert isinstance(policy, AutoPrecision) and policy.avg_bits == avg
        assert policy.swap == (name == "G3")
    assert list(HOOK_LEVELS) == ["G0", "G1", "G1.1", "G1.2", "G2", "G2.1", "G2.2", "G3"]
    with pytest.raises(ValueError, match=r"unknown level 'G4'; valid levels: G0, G1, G1\.1"):
        Controller(model, "G4")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bitz'\]"):
        Controller(model, "G1", bitz=3)
    acgc = Controller(model, policy="acgc", error_bound=0.2).policy
    assert isinstance(acgc, ACGC) and acgc.error_bound == 0.2
    assert actcore.Controller is Controller


def test_install_uninstall_and_context_manager() -> None:
    model = _mlp()
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    c = Controller(model, "G1.2", min_numel=1)
    with actcore.memory.track(model) as plain:
        out = model(x)
    del out
    c.install_hook()
    assert c.installed
    with actcore.memory.track(model) as packed:
        out = model(x)
    c.uninstall_hook()
    assert not c.installed
    F.cross_entropy(out, y).backward()  # a graph built while installed still backpropagates
    assert packed.retained_bytes < plain.retained_bytes / 4
    with Controller(model, "G0") as c0:
        assert c0.installed
    assert not c0.installed


def test_parameters_and_buffers_never_compressed_after_to() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.register_buffer("scale", torch.rand(64, 64) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale  # mul saves the buffer for d/dx

    model = Scale()
    with Controller(model, "G1.2", min_numel=1):
        for dtype in (torch.float32, torch.float64):
            model.to(dtype)
            x = torch.randn(64, 64, dtype=dtype, requires_grad=True)
            h = model.lin(x).detach().requires_grad_()
            (h * model.scale).sum().backward()
            # d/dh of h*scale is exactly the buffer when the buffer was kept as is
            assert torch.equal(h.grad, model.scale)
            model.zero_grad()
            out = model(x)
            out.sum().backward()
            # exact gradient wrt x: the buffer (saved by mul) and weight were kept as they are
            assert torch.allclose(x.grad, model.scale @ model.lin.weight)


def test_state_dict_round_trip_resumes_same_plan() -> None:
    model = _mlp()
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    backprop = cross_entropy_backprop(model, x, y)
    c = Controller(model, "G2.1", adapt_interval=3, min_numel=1)
    train_iterations(c, backprop, 4)  # adapts at iteration 0 and 3
    plan = c.bit_plan
    assert plan and c.iteration == 4 and c.policy.estimates == 2
    state = c.state_dict()
    resumed = Controller(model, "G2.1", adapt_interval=3, min_numel=1)
    resumed.load_state_dict(state)
    assert resumed.bit_plan == plan and resumed.iteration == 4
    again = resumed.state_dict()
    scales, scales_again = state.pop("channel_scales"), again.pop("channel_scales")
    assert again == state
    assert scales.keys() == scales_again.keys() and scales  # the save sites' kept scales
    for key, entry in scales.items():
        other = scales_again[key]
        assert entry["uses"] == other["uses"] and entry["signature"] == other["signature"]
        for part in ("exponents", "top"):
            a, b = entry[part], other[part]
            assert (a is None and b is None) or torch.equal(a, b)
    with resumed:
        backprop()
        resumed.iterate(backprop)  # iteration 4: no re-estimation, same plan
        assert resumed.bit_plan == plan and resumed.policy.estimates == 2
        for key, bits in plan.items():
            assert resumed.policy.bits_for(key) == bits
    with pytest.raises(ValueError, match="'auto' policy given to 'acgc'"):
        Controller(model, policy="acgc").load_state_dict(state)


def test_iterate_restores_gradients_and_rng() -> None:
    model = nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.3), nn.GELU(), nn.Linear(128, 4))
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    backprop = cross_entropy_backprop(model, x, y)
    with Controller(model, "G2", min_numel=1) as c:
        backprop()
        grads = [p.grad.clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        c.iterate(backprop)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
        assert torch.equal(rng, torch.get_rng_state())
        with pytest.raises(ValueError, match="needs the backprop callable"):
            Controller(model, "G2").iterate()


def _fsdp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
        x = torch.randn(2 * 16, 32)
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        c = Controller(model, "G1.1", min_numel=1)
        kinds: list[tuple[bool, bool]] = []  # (is a parameter or view of one, compressed)
        pack = c.saved_tensor_hooks.pack

        def counting_pack(t: torch.Tensor):
            h = pack(t)
            param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
            kinds.append((param, getattr(h, "stored", None) is not None))
            return h

        c.saved_tensor_hooks.pack = counting_pack  # type: ignore[method-assign]
        with c:
            loss = model(x[rank * 16 : (rank + 1) * 16]).square().mean()
            loss.backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        if rank == 0:
            torch.save((grads, kinds), f"{out_dir}/grads.pt")
        # Both ranks done before either tears its connections down: a rank that destroyed
        # the group (and exited) while its peer still had gloo work in flight made the
        # peer's gloo thread die with "terminate called without an active exception".
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_fully_shard_two_gloo_processes(tmp_path) -> None:
    """FSDP2 all-gathers parameters as ``nn.Parameter``s: they are never compressed, and the
    8-bit gradients match a single-process run on the whole batch."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    x = torch.randn(2 * 16, 32)
    model(x).square().mean().backward()
    exact = torch.cat([p.grad.flatten() for p in model.parameters()])
    grads, kinds = torch.load(tmp_path / "grads.pt")
    assert (True, False) in kinds and (False, True) in kinds  # weights kept, activations packed
    assert (True, True) not in kinds
    sharded = torch.cat([g.flatten() for g in grads])
    assert float(F.cosine_similarity(exact, sharded, dim=0)) >= 0.99


def test_keys_name_modules_not_forward_order() -> None:
    """Keys are (module, call of it in this forward, index of the save within the call):
    running submodules in another order leaves every submodule's keys the same."""

    class TwoBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(24, 64)
            self.swap = False

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            if self.swap:
                return self.b(z).sum() + self.a(x).sum()
            return self.a(x).sum() + self.b(z).sum()

    model = TwoBranch()
    c = Controller(model, "G1", min_numel=1)
    seen: dict[str, torch.Size] = {}
    keys = c.saved_tensor_hooks._keys
    pack, next_key = c.saved_tensor_hooks.pack, keys.next_key
    last: list[str] = []

    def record_key() -> str:
        last.append(next_key())
        return last[-1]

    def record_pack(t: torch.Tensor):
        n = len(last)
        h = pack(t)
        if len(last) > n:
            seen[last[-1]] = t.shape
        return h

    keys.next_key = record_key  # type: ignore[method-assign]
    c.saved_tensor_hooks.pack = record_pack  # type: ignore[method-assign]
    x, z = torch.randn(8, 16, requires_grad=True), torch.randn(8, 24, requires_grad=True)
    with c:
        model(x, z)
        first = dict(seen)
        seen.clear()
        model.swap = True
        model(x, z)
    assert first == seen
    assert first["a#0:0"] == x.shape and first["b#0:0"] == z.shape


def test_keys_outside_the_model_are_stable_across_iterations() -> None:
    model = _mlp()
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    c = Controller(model, "G2", adapt_interval=2, min_numel=1)
    train_iterations(c, cross_entropy_backprop(model, x, y), 3)  # adapts at iterations 0 and 2
    outside = [k for k in c.bit_plan if k.startswith("<outside>")]
    assert outside and all(int(k.split(":")[1]) < 4 for k in outside)  # the loss's saves
    assert len(c.bit_plan) == len(c.policy.sensitivity)  # same keys in both estimates
