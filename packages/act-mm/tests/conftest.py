"""What several of act-mm's test modules share: helpers they import
(``from conftest import two_iteration_runner``; this folder is on ``sys.path`` under pytest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset

__all__ = ["two_iteration_runner"]


def two_iteration_runner(
    tmp_path: Path,
    experiment: str,
    model: nn.Module | dict,
    dataset: Dataset,
    *,
    batch_size: int,
    collate: str,
    lr: float,
    hooks: list,
    scope: str,
    **kwargs: Any,
) -> Runner:
    """An mmengine ``Runner`` (work directory ``tmp_path``, experiment name ``experiment``)
    that trains ``model`` (a module or a config) for two iterations of SGD on ``dataset`` in
    order (no workers, no checkpoints, the loss logged every iteration); ``kwargs`` go to
    the ``Runner`` as they are."""
    return Runner(
        model=model,
        work_dir=str(tmp_path),
        experiment_name=experiment,
        train_dataloader=dict(
            dataset=dataset,
            sampler=dict(type="DefaultSampler", shuffle=False),
            batch_size=batch_size,
            num_workers=0,
            collate_fn=dict(type=collate),
        ),
        train_cfg=dict(by_epoch=False, max_iters=2),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=lr, momentum=0.9)),
        default_hooks=dict(logger=dict(type="LoggerHook", interval=1), checkpoint=None),
        custom_hooks=hooks,
        default_scope=scope,
        **kwargs,
    )
