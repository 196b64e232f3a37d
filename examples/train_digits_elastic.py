"""Elastic training of the digits CNN with LEGACY-compressed gradients: workers may fail, leave
and join while training goes on.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh --network-interface lo \\
        python examples/train_digits_elastic.py

``discover.sh`` prints one ``host:slots`` line per available host (``localhost:2``; on one
machine ``localhost`` and ``127.0.0.1`` are two hosts). ``--network-interface lo`` is for a job
on one machine: without it an elastic job waits for two hosts to compare their interfaces. Horovod runs
the script about once a second; when its answer changes, or a worker fails, the workers reset:
every survivor goes back to the last ``state.commit()`` (model, optimizer, and the compression
state: error-feedback residuals, the schedule's progress, the step counters behind the random
draws), newcomers receive rank 0's model, optimizer and schedule, and training continues.

Every step uses a global batch of ``--global-batch`` samples from one permutation per epoch that
every rank draws alike, split among however many workers there are now, so a reset in the middle
of an epoch neither repeats nor skips samples and the learning rate need not change with the
number of workers. At the end rank 0 prints the test accuracy, the number of workers, how often
the world changed, and the bytes it sent compared with an uncompressed allreduce.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from torch import nn
from train_digits import DigitsCNN, load_split

import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer and hvd.elastic.TorchState accept our compression)
from grace_legacy import Grace, Legacy, Residual, TopK


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step, over all workers")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--commit-every", type=int, default=10, help="steps between commits of the elastic state")
    parser.add_argument("--group-compressions", default="100,10,1",
                        help="Top-k densities in percent per size group")
    parser.add_argument("--group-splits", default="1000,10000", help="size-group thresholds in elements")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_split(args.seed)

    model = DigitsCNN()
    compression = Grace(Legacy.from_flags(TopK(), "layer", group_compressions=args.group_compressions,
                                            group_splits=args.group_splits), memory=Residual())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                         named_parameters=model.named_parameters(), compression=compression)
    # No broadcast here: collectives belong inside hvd.elastic.run, whose first sync sends rank
    # 0's model, optimizer and compression state to every worker (and to every later newcomer).
    state = hvd.elastic.TorchState(model, optimizer, compression=compression, epoch=0, batch=0, worlds=0)
    steps_per_epoch = len(y_train) // args.global_batch

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        # Entered once at the start and again after every reset, once the state is synchronized.
        state.worlds += 1
        while state.epoch < args.epochs:
            compression.set_epoch(state.epoch)
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(args.seed + state.epoch))
            model.train()
            while state.batch < steps_per_epoch:
                chosen = order[state.batch * args.global_batch:(state.batch + 1) * args.global_batch]
                mine = chosen[hvd.rank()::hvd.size()]
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x_train[mine]), y_train[mine])
                loss.backward()
                optimizer.step()
                state.batch += 1
                if state.batch % args.commit_every == 0:
                    state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: {hvd.size()} workers, loss {loss.item():.3f}", flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    stats = compression.stats
    resets = state.worlds - 1
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.2%} | {hvd.size()} workers at the end, {resets} reset{'s' * (resets != 1)} | "
              f"rank 0 sent {stats['bytes_sent'] / 1e6:.3f} MB vs {stats['bytes_dense'] / 1e6:.3f} MB dense: "
              f"volume {stats['volume']:.2%}")


if __name__ == "__main__":
    main()
