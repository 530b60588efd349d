"""ACTConvertHook: converts a runner's model in place, before training, from one config entry."""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import two_iteration_runner
from mmengine.hooks import Hook
from mmengine.logging import MMLogger
from mmengine.model import BaseModel
from mmengine.registry import HOOKS, MODELS
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset

import act_mm  # registers the Q-layers and the hook
import actcore
from actcore.layers import QLayer


class TinyNet(BaseModel):
    """conv-bn-relu built from registry configs (already Q-layers) + stock layers + a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = MODELS.build(
            dict(type="QConv2d", in_channels=3, out_channels=8, kernel_size=3, padding=1)
        )
        self.bn1 = MODELS.build(dict(type="QBN", num_features=8))
        self.act1 = MODELS.build(dict(type="QReLU"))
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.act2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 8 * 8, 4)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, mode="tensor"):
        x = self.act1(self.bn1(self.conv1(inputs)))
        x = self.pool(self.act2(self.bn2(self.conv2(x))))
        logits = self.fc(x.flatten(1))
        if mode == "loss":
            return dict(loss=F.cross_entropy(logits, labels))
        return logits


class RandomImages(Dataset):
    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.x[i], labels=self.y[i])


class RecordHook(Hook):
    """Records, at the first iteration, the layer classes and the optimizer's parameters."""

    priority = "LOWEST"

    def __init__(self) -> None:
        self.seen: dict = {}

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if batch_idx == 0:
            model = runner.model
            self.seen["types"] = {n: type(m) for n, m in model.named_modules()}
            groups = runner.optim_wrapper.optimizer.param_groups
            self.seen["optim_ids"] = {id(p) for g in groups for p in g["params"]}
            self.seen["model_ids"] = {id(p) for p in model.parameters()}


def _runner(tmp_path: Path, model: nn.Module, hooks: list) -> Runner:
    return two_iteration_runner(
        tmp_path,
        f"act_mm_{tmp_path.name}",
        model,
        RandomImages(),
        batch_size=4,
        collate="default_collate",
        lr=0.1,
        hooks=hooks,
        scope="mmengine",
        log_level="INFO",
    )


def test_runner_trains_converted_model(tmp_path):
    model = TinyNet()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    params_at_build = {id(p) for p in model.parameters()}
    record = RecordHook()
    runner = _runner(tmp_path, model, [dict(type="ACTConvertHook", level="L3"), record])
    runner.train()

    # converted before the first iteration, registry-built Q-layers kept
    types = record.seen["types"]
    assert issubclass(types["conv2"], actcore.QConv2d)
    assert issubclass(types["bn2"], actcore.QBatchNorm2d)
    assert issubclass(types["act2"], actcore.QReLU)
    assert issubclass(types["pool"], actcore.QMaxPool2d)
    assert issubclass(types["fc"], actcore.QLinear)
    assert types["bn1"] is MODELS.get("QBN")
    assert all(m.act_level == "L3" for m in model.modules() if isinstance(m, QLayer))
    # the optimizer (built in Runner.train before `before_run`) holds the same Parameters
    assert record.seen["optim_ids"] == record.seen["model_ids"] == params_at_build
    state = runner.optim_wrapper.optimizer.state
    assert all("momentum_buffer" in state[p] for p in model.parameters())
    # it trained
    loss = runner.message_hub.get_scalar("train/loss").current()
    assert math.isfinite(loss)
    assert runner.iter == 2
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"
    # what was converted was logged
    report = model.act_report
    assert report.level == "L3" and len(report.converted) == 8
    log_text = "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert f"ACTConvertHook: {len(report.converted)} modules at level L3" in log_text


class SyncBNNet(TinyNet):
    """TinyNet whose norms are SyncBN, as MoCo's config builds them."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = MODELS.build(dict(type="QSyncBN", num_features=8))
        self.bn2 = nn.SyncBatchNorm(16)


def test_single_process_runner_reverts_syncbn_and_the_hook_compresses_it_again(tmp_path):
    from mmengine.model.utils import _BatchNormXd

    record = RecordHook()
    model = SyncBNNet()
    runner = _runner(tmp_path, model, [dict(type="ACTConvertHook", level="L3"), record])
    runner.train()
    types = record.seen["types"]
    # mmengine swapped both SyncBNs for _BatchNormXd; convert made those Q-layers again
    for name in ("bn1", "bn2"):
        assert types[name] is act_mm.QBatchNormXd
        assert issubclass(types[name], _BatchNormXd)
    assert runner.model.act_report.converted["bn1"] == "QBatchNormXd"
    with actcore.memory.track(runner.model.bn2) as mem:
        out = runner.model.bn2(torch.randn(4, 16, 8, 8, requires_grad=True))
    assert 0 < mem.retained_bytes < 4 * 16 * 8 * 8 * 4 / 4  # compressed, not the fp32 input
    del out


def test_register_q_layer_refuses_a_second_mapping_for_xd():
    from mmengine.model.utils import _BatchNormXd

    from actcore.layers import QBatchNormBase, register_q_layer

    class OtherXd(QBatchNormBase, _BatchNormXd):
        pass

    register_q_layer(_BatchNormXd, act_mm.QBatchNormXd)  # again: a no-op
    with pytest.raises(ValueError, match="_BatchNormXd already converts to QBatchNormXd"):
        register_q_layer(_BatchNormXd, OtherXd)
    with pytest.raises(TypeError, match="QBN2d must subclass both _BatchNormXd"):
        register_q_layer(_BatchNormXd, act_mm.QBN2d)


def test_conversion_keeps_forward_and_state_dict():
    torch.manual_seed(0)
    stock = TinyNet()
    model = copy.deepcopy(stock)
    hook = HOOKS.build(dict(type="ACTConvertHook", level="L2", exclude=["fc"]))
    logger = MMLogger.get_instance("act_mm_test_forward", log_level=logging.WARNING)
    hook.before_run(SimpleNamespace(model=model, logger=logger))
    assert type(model.conv2) is actcore.QConv2d and type(model.fc) is nn.Linear
    assert hook.report.left["fc"] == "excluded"
    assert list(model.state_dict()) == list(stock.state_dict())
    x = torch.randn(2, 3, 16, 16)
    out_q = model(x.clone().requires_grad_())
    out_s = stock(x.clone().requires_grad_())
    assert torch.equal(out_q, out_s)


def test_hook_converts_inside_a_ddp_wrapper():
    import torch.distributed as dist
    from mmengine.model import MMDistributedDataParallel

    port = 29500 + os.getpid() % 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        inner = TinyNet()
        ddp = MMDistributedDataParallel(module=inner)
        ids = [id(p) for p in ddp.parameters()]
        hook = HOOKS.build(dict(type="ACTConvertHook"))
        hook.before_run(SimpleNamespace(model=ddp, logger=MMLogger.get_current_instance()))
        assert isinstance(inner.conv2, actcore.QConv2d) and isinstance(inner.fc, actcore.QLinear)
        assert [id(p) for p in ddp.parameters()] == ids
        data = RandomImages()[0]
        loss = ddp(data["inputs"][None], data["labels"][None], mode="loss")["loss"]
        loss.backward()  # DDP's reducer still sees every parameter's gradient
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in inner.parameters())
    finally:
        dist.destroy_process_group()


def test_unknown_level_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown optimization level 'L9'.*valid levels: L0"):
        HOOKS.build(dict(type="ACTConvertHook", level="L9"))
