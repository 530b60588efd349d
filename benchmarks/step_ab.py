"""One torchvision model's steady training step at a level, for paired runs across commits.

    PYTHONPATH=<checkout>/packages/actcore/src python benchmarks/step_ab.py resnet50 L3
    PYTHONPATH=... python benchmarks/step_ab.py resnet50 L3 --calls

Prints the median time of the last 6 of 8 SGD steps at batch 4 x 224x224 (one torch
thread), or with ``--calls`` the number of ``aten::`` events torch.profiler records in the
4th step at batch 2 x 64x64 (deterministic: a count of the per-op work, free of timing
noise). Run it with each commit's sources on ``PYTHONPATH``, the commits interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

import actcore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a torchvision.models builder, e.g. resnet50")
    p.add_argument("level", help="fp, or an actcore level such as L3")
    p.add_argument("--calls", action="store_true", help="count ATen calls instead of timing")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10)
    if args.level != "fp":
        actcore.convert(model, level=args.level)
    batch, size = (2, 64) if args.calls else (4, 224)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if args.calls:
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(sum(e.name.startswith("aten::") for e in prof.events()))
        return
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(statistics.median(times[2:]))


if __name__ == "__main__":
    main()
