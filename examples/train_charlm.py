"""A character-level LSTM language model on Python's own standard-library sources, trained data
parallel with a budget-matched LEGACY schedule (by layer size and training phase at once).

    horovodrun -np 4 -H localhost:4 python examples/train_charlm.py
    horovodrun -np 4 -H localhost:4 python examples/train_charlm.py --budget 0.5 --phase-factors 4,1,0.25

The text is every ``.py`` file of the running Python's standard library, read as bytes (a 256-symbol
vocabulary), in sorted order; the first ``--chars`` bytes are used, the last 10% of them held out
for validation. Each worker trains on its own share of the training windows.

Gradients are compressed with Top-k and error feedback. The schedule is built by
``Legacy.budget_matched``: its shape is relative (``--layer-factors``: small tensors get 10x the
density of large ones; ``--phase-factors``: early phases get more than late ones) and its scale is
chosen so that the whole run sends as many bytes as uniform Top-k at ``--budget`` percent would.
Rank 0 prints the validation perplexity after every epoch and, at the end, the wire volume (link
bytes against a dense ring allreduce's, the ranks' mean) next to uniform Top-k's at the budget.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import grace_legacy  # noqa: F401  (makes hvd.DistributedOptimizer accept grace_legacy compression)
from grace_legacy import Grace, Legacy, Residual, TopK
from grace_legacy.planner import plan


class CharLSTM(nn.Module):
    def __init__(self, embedding: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, embedding)
        self.lstm = nn.LSTM(embedding, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out)


def standard_library_text(chars: int) -> torch.Tensor:
    """The first ``chars`` bytes of the standard library's sources (sorted paths), as int64."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        pieces.append(data)
        total += len(data)
        if total >= chars:
            break
    text = b"".join(pieces)[:chars]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--chars", type=int, default=500_000, help="bytes of source text used")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--steps-per-epoch", type=int, default=60)
    parser.add_argument("--embedding", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.002, help="Adam's, the same at any number of workers")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="bytes to match: uniform Top-k at this density, in percent")
    parser.add_argument("--group-splits", default="1000", help="size-group thresholds in elements")
    parser.add_argument("--layer-factors", default="10,1", help="relative density per size group")
    parser.add_argument("--phase-factors", default="2,1,0.5", help="relative density per phase")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def numbers(text: str, kind: type) -> list:
    return [kind(t) for t in text.split(",") if t.strip()]


@torch.no_grad()
def perplexity(model: nn.Module, text: torch.Tensor, seq_len: int) -> float:
    """exp of the mean next-byte cross entropy over ``text`` in windows of ``seq_len``."""
    model.eval()
    windows = (len(text) - 1) // seq_len
    x = text[:windows * seq_len].view(windows, seq_len)
    y = text[1:windows * seq_len + 1].view(windows, seq_len)
    total = 0.0
    for start in range(0, windows, 256):
        logits = model(x[start:start + 256])
        total += nn.functional.cross_entropy(logits.reshape(-1, 256), y[start:start + 256].reshape(-1),
                                             reduction="sum").item()
    model.train()
    return math.exp(total / (windows * seq_len))


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    text = standard_library_text(args.chars)
    cut = int(0.9 * len(text))
    train, valid = text[:cut], text[cut:]

    model = CharLSTM(args.embedding, args.hidden, args.layers)
    splits = numbers(args.group_splits, int)
    schedule = Legacy.budget_matched(TopK(), args.budget / 100, by="both", sizes=model.named_parameters(),
                                     splits=splits, layer_factors=numbers(args.layer_factors, float),
                                     phase_factors=numbers(args.phase_factors, float), epochs=args.epochs,
                                     world_size=hvd.size())
    compression = Grace(schedule, memory=Residual())
    if hvd.rank() == 0:
        print(f"{len(train):,} training and {len(valid):,} validation bytes of standard-library source")
        print(f"LEGACY schedule: {schedule.to_flags()}")
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                         named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    starts_available = len(train) - args.seq_len - 1
    for epoch in range(args.epochs):
        compression.set_epoch(epoch)
        for _ in range(args.steps_per_epoch):
            starts = torch.randint(0, starts_available, (args.batch_size,), generator=generator)
            offsets = starts[:, None] + torch.arange(args.seq_len + 1)
            window = train[offsets]
            optimizer.zero_grad()
            logits = model(window[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {loss.item():.3f}, "
                  f"validation perplexity {perplexity(model, valid, args.seq_len):.2f}", flush=True)

    # The ranks' mean wire volume (a scatter-gather loads the ranks a little unequally: the owner of
    # the first shard carries less), and uniform Top-k's as the planner predicts it for this model.
    stats = compression.stats
    volume = stats["volume"]
    if hvd.size() > 1:
        wire, dense = hvd.allreduce(torch.tensor([stats["wire_bytes"], stats["wire_dense"]], dtype=torch.float64),
                                    op=hvd.Sum, name="charlm.volume").tolist()
        volume = wire / dense
    budget = plan(TopK(args.budget / 100), model.named_parameters(), world_size=hvd.size()).volume
    if hvd.rank() == 0:
        print(f"validation perplexity {perplexity(model, valid, args.seq_len):.2f} | {hvd.size()} workers | "
              f"volume {volume:.2%} (uniform Top-k {args.budget:g}%: {budget:.2%})")

if __name__ == "__main__":
    main()
