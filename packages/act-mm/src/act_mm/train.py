"""``python -m act_mm.train CONFIG``: train an OpenMMLab config with mmengine's Runner.

CONFIG is a config file, or the name of a config shipped with act_mm (e.g.
``retinanet_r50_fpn_1x_coco_act``; see :func:`act_mm.shipped_configs`). The same as the frameworks'
own ``tools/train.py`` without its extras, for installs that have no framework checkout.
"""

from __future__ import annotations

import argparse
import os.path as osp
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


def shipped_configs() -> dict[str, Path]:
    """Shipped config name (file stem) -> path."""
    return {p.stem: p for p in sorted(CONFIG_DIR.glob("*/*.py"))}


def config_path(name: str) -> Path:
    """The path of a config file or of a shipped config's name (FileNotFoundError if neither)."""
    if osp.isfile(name):
        return Path(name)
    shipped = shipped_configs()
    stem = Path(name).stem
    if stem in shipped:
        return shipped[stem]
    raise FileNotFoundError(
        f"no config file {name!r} and no shipped act_mm config of that name; shipped: "
        + ", ".join(shipped)
    )


def main(argv: list[str] | None = None) -> None:
    from mmengine.config import Config, DictAction
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    parser = argparse.ArgumentParser(description="Train an OpenMMLab config (with act_mm).")
    parser.add_argument("config", help="config file, or the name of a shipped act_mm config")
    parser.add_argument("--work-dir", help="where logs and checkpoints go")
    parser.add_argument(
        "--launcher",
        choices=["none", "pytorch", "slurm", "mpi"],
        default="none",
        help="job launcher (pytorch: under torchrun)",
    )
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    parser.add_argument(
        "--cfg-options", nargs="+", action=DictAction, help="override config entries, key=value"
    )
    args = parser.parse_args(argv)
    path = config_path(args.config)
    cfg = Config.fromfile(str(path))
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.work_dir = args.work_dir or cfg.get("work_dir") or osp.join("work_dirs", path.stem)
    cfg.launcher = args.launcher
    if args.resume:
        cfg.resume = True
    runner = RUNNERS.build(cfg) if "runner_type" in cfg else Runner.from_cfg(cfg)
    runner.train()


if __name__ == "__main__":
    main()
