"""act_mm's shipped configs on the real OpenMMLab stack (mmcv with its ops, mmdet, mmseg,
mmpretrain): they build, train through mmengine, keep forward and state_dict, save memory.

Each test needs its framework installed; mmdet and mmseg also need mmcv's compiled ops
(``mmcv._ext``), not mmcv-lite. CPU only, small random images.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import two_iteration_runner
from torch import nn

import act_mm
import actcore
from actcore.layers import QLayer

CONFIGS = Path(act_mm.__file__).parent / "configs"


def _has_ops() -> bool:
    try:
        return importlib.util.find_spec("mmcv._ext") is not None
    except ImportError:
        return False


@dataclass(frozen=True)
class Case:
    config: str  # relative to act_mm/configs
    stock: str  # the stock config it inherits
    package: str  # the framework (and default scope)
    ops: bool  # needs mmcv's compiled ops
    detector_like: bool  # the >= 10x memory claim applies (detectors, segmentors)


CASES = {
    "retinanet": Case(
        "mmdet/retinanet_r50_fpn_1x_coco_act.py",
        "mmdet::retinanet/retinanet_r50_fpn_1x_coco.py",
        "mmdet",
        True,
        True,
    ),
    "faster_rcnn": Case(
        "mmdet/faster-rcnn_r50_fpn_1x_coco_act.py",
        "mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py",
        "mmdet",
        True,
        True,
    ),
    "fcn": Case(
        "mmseg/fcn_r50-d8_4xb2-80k_cityscapes-512x1024_act.py",
        "mmseg::fcn/fcn_r50-d8_4xb2-80k_cityscapes-512x1024.py",
        "mmseg",
        True,
        True,
    ),
    "mocov2": Case(
        "mmpretrain/mocov2_resnet50_8xb32-coslr-200e_in1k_act.py",
        "mmpretrain::mocov2/mocov2_resnet50_8xb32-coslr-200e_in1k.py",
        "mmpretrain",
        False,
        False,
    ),
}
SIZE = 128  # image side


def _require(case: Case) -> None:
    """Skip without the framework, except in tox's act-mm-openmmlab env, where it fails."""
    missing = None
    if importlib.util.find_spec(case.package) is None:
        missing = f"{case.package} is not installed"
    elif case.ops and not _has_ops():
        missing = "mmcv's compiled ops (mmcv._ext) are not installed"
    if missing and os.environ.get("ACT_REQUIRE_OPENMMLAB") == "1":
        pytest.fail(f"{missing}, and ACT_REQUIRE_OPENMMLAB=1 (tox -e act-mm-openmmlab)")
    if missing:
        pytest.skip(missing)


def _cfg(path: str) -> Any:
    """The config, made offline and small: no pretrained weights, a short MoCo queue."""
    from mmengine.config import Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = Config.fromfile(path) if "::" not in path else _stock(path)
    model = cfg.model
    model.pop("pretrained", None)
    model.backbone.init_cfg = None
    if model.type == "MoCo":
        model.queue_len = 64
    if model.get("data_preprocessor", {}).get("size") is not None:  # mmseg pads to crops
        model.data_preprocessor.size = (SIZE, SIZE)
    return cfg


def _stock(path: str) -> Any:
    from mmengine.hub import get_config

    return get_config(path)


def _build(case: Case, stock: bool = False) -> nn.Module:
    from mmengine.registry import MODELS, init_default_scope

    cfg = _cfg(case.stock if stock else str(CONFIGS / case.config))
    init_default_scope(case.package)
    with MODELS.switch_scope_and_registry(case.package) as registry:
        return registry.build(cfg.model)


def _batch(case: Case, n: int = 2) -> list[dict]:
    """``n`` random training samples in the framework's data format."""
    g = torch.Generator().manual_seed(0)

    def image() -> torch.Tensor:
        return torch.randint(0, 256, (3, SIZE, SIZE), generator=g, dtype=torch.uint8)

    if case.package == "mmdet":
        from mmdet.testing import demo_mm_inputs

        packed = demo_mm_inputs(batch_size=n, image_shapes=(3, SIZE, SIZE), num_classes=80)
        return [
            dict(inputs=packed["inputs"][i], data_samples=packed["data_samples"][i])
            for i in range(n)
        ]
    if case.package == "mmseg":
        from mmengine.structures import PixelData
        from mmseg.structures import SegDataSample

        items = []
        for _ in range(n):
            sample = SegDataSample(
                metainfo=dict(
                    img_shape=(SIZE, SIZE), ori_shape=(SIZE, SIZE), pad_shape=(SIZE, SIZE)
                )
            )
            seg = torch.randint(0, 19, (1, SIZE, SIZE), generator=g)
            sample.gt_sem_seg = PixelData(data=seg)
            items.append(dict(inputs=image(), data_samples=sample))
        return items
    from mmpretrain.structures import DataSample

    return [dict(inputs=[image(), image()], data_samples=DataSample()) for _ in range(n)]


def _features(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Backbone + neck outputs."""
    if hasattr(model, "extract_feat") and model.__class__.__name__ != "MoCo":
        out = model.extract_feat(x)
    else:
        out = model.neck(model.backbone(x))
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _backbone_neck(model: nn.Module) -> nn.Module:
    parts = nn.ModuleDict({"backbone": model.backbone})
    if getattr(model, "neck", None) is not None:
        parts["neck"] = model.neck
    return parts


def test_shipped_configs_are_found_by_name():
    shipped = act_mm.shipped_configs()
    assert {Path(c.config).stem for c in CASES.values()} == set(shipped)
    for case in CASES.values():
        path = act_mm.config_path(Path(case.config).stem)
        assert path == CONFIGS / case.config and path.is_file()
        assert act_mm.config_path(str(path)) == path
        assert "_base_ = " in path.read_text() and repr(case.stock)[1:-1] in path.read_text()
    with pytest.raises(FileNotFoundError, match=r"no shipped act_mm config.*retinanet"):
        act_mm.config_path("retinanet_r18")


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_builds_with_q_layers_and_stock_names(name):
    case = CASES[name]
    _require(case)
    model = _build(case)
    block = model.backbone.layer1[0]  # a Bottleneck, built through conv_cfg / norm_cfg
    assert isinstance(block.conv1, actcore.QConv2d)
    assert block.norm1_name == "bn1"  # mmcv's naming, as in the stock model
    assert isinstance(block.bn1, actcore.QBatchNorm2d | actcore.QSyncBatchNorm)
    actcore.convert(model, level="L3")
    for mod_name, module in model.named_modules():
        if type(module) in actcore.layers.Q_LAYERS:  # a stock layer left unconverted
            assert mod_name in model.act_report.left, mod_name


@pytest.mark.parametrize("name", sorted(CASES))
def test_stock_weights_load_and_forward_is_unchanged(name):
    case = CASES[name]
    _require(case)
    torch.manual_seed(0)
    stock = _build(case, stock=True)
    model = _build(case)
    actcore.convert(model, level="L3")
    assert list(model.state_dict()) == list(stock.state_dict())
    model.load_state_dict(stock.state_dict(), strict=True)
    model.train()
    stock.train()
    x = torch.randn(2, 3, SIZE, SIZE)
    out = _features(model, x.clone().requires_grad_())
    ref = _features(stock, x.clone().requires_grad_())
    assert len(out) == len(ref)
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_training_iterations_through_mmengine(name, tmp_path):
    case = CASES[name]
    _require(case)
    from torch.utils.data import Dataset

    cfg = _cfg(str(CONFIGS / case.config))
    items = _batch(case)
    collate = cfg.train_dataloader.get("collate_fn", {}).get("type", "pseudo_collate")

    class Items(Dataset):
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int) -> dict:
            return items[i]

    runner = two_iteration_runner(
        tmp_path,
        f"act_mm_{name}_{tmp_path.name}",
        cfg.model,
        Items(),
        batch_size=2,
        collate=collate,
        lr=0.01,
        hooks=cfg.custom_hooks,
        scope=case.package,
    )
    model = runner.model
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    runner.train()
    assert model.act_report.level == "L3" and model.act_report.converted
    assert not any(type(m) in actcore.layers.Q_LAYERS for m in model.modules())
    assert math.isfinite(runner.message_hub.get_scalar("train/loss").current())
    changed = [
        k for k, v in model.named_parameters() if k in before and not torch.equal(v, before[k])
    ]
    assert any(k.startswith("backbone.") for k in changed)
    assert len(changed) >= 0.5 * len(before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_backbone_and_neck_keep_far_fewer_activation_bytes(name, capsys):
    case = CASES[name]
    _require(case)
    from actcore import memory

    torch.manual_seed(0)
    stock = _build(case, stock=True).train()
    model = _build(case).train()
    actcore.convert(model, level="L3")
    model.load_state_dict(stock.state_dict())
    x = torch.randn(2, 3, SIZE, SIZE)
    with memory.track(_backbone_neck(stock)) as ref:
        ref_out = _features(stock, x.clone().requires_grad_())  # kept: its graph holds the bytes
    with memory.track(_backbone_neck(model)) as rep:
        out = _features(model, x.clone().requires_grad_())
    assert len(out) == len(ref_out)
    ratio = ref.retained_bytes / rep.retained_bytes
    with capsys.disabled():
        print(
            f"\n[act_mm] {name}: backbone+neck retained {ref.retained_bytes / 2**20:.1f} MiB "
            f"stock, {rep.retained_bytes / 2**20:.2f} MiB at L3: {ratio:.1f}x "
            f"(batch 2, {SIZE}x{SIZE})"
        )
    assert rep.retained_bytes > 0
    if case.detector_like:
        assert ratio >= 10
    else:
        assert ratio >= 5
    assert not any(type(m) in actcore.layers.Q_LAYERS for m in _backbone_neck(model).modules())
    assert all(isinstance(m, QLayer) for m in model.backbone.modules() if isinstance(m, nn.Conv2d))
