"""Training throughput of a torchvision model on synthetic data, with any grace_legacy compression.

    horovodrun -np 4 -H localhost:4 python examples/pytorch_synthetic_benchmark.py --model resnet50
    horovodrun -np 4 -H localhost:4 python examples/pytorch_synthetic_benchmark.py --compression topk:0.01
    horovodrun -np 4 -H localhost:4 python examples/pytorch_synthetic_benchmark.py --compression topk \\
        --legacy-by layer --group-compressions 100,1 --group-splits 100000

The flags and output follow Horovod's script of the same name: ``--model`` (any constructor in
``torchvision.models``), ``--batch-size``, ``--num-warmup-batches``, ``--num-batches-per-iter``,
``--num-iters``; it prints img/sec per worker for every iteration, their mean +- 1.96 std, and the
total. Added: ``--compression NAME[:VALUE]`` with any compressor name ``grace_from_params`` knows
(``none``, ``fp16``, ``topk``, ``qsgd``, ``powersgd``, ...; VALUE sets its parameter, GRACE's
default otherwise), which runs with the compressor's recommended memory and the communicator its
payload needs; with ``--legacy-by``/``--group-compressions``/``--group-splits``/``--epochs`` (the
LEGACY reference flags) the parameter follows a LEGACY schedule instead. The last line is the
bytes a worker handed to its collectives per step, against an uncompressed allreduce.
"""

from __future__ import annotations

import argparse
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torchvision import models

from grace_legacy import Grace, Legacy
from grace_legacy.helper import compressor_from_name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="a constructor in torchvision.models")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    parser.add_argument("--num-warmup-batches", type=int, default=10, help="batches not counted")
    parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="benchmark iterations")
    parser.add_argument("--image-size", type=int, default=224, help="side of the synthetic square images")
    parser.add_argument("--no-cuda", action="store_true", help="train on the CPU even if CUDA is available")
    parser.add_argument("--fp16-allreduce", action="store_true", help="Horovod's flag: the same as --compression fp16")
    parser.add_argument("--compression", default="none",
                        help="NAME[:VALUE]: a compressor as grace_from_params names it, e.g. topk:0.01, qsgd:64")
    parser.add_argument("--legacy-by", choices=["uniform", *Legacy.MODES],
                        help="schedule the compressor's parameter with LEGACY (reference flag)")
    parser.add_argument("--group-compressions", help="LEGACY values per size group, ';' between phases "
                                                     "(a density in percent)")
    parser.add_argument("--group-splits", default="", help="LEGACY size-group thresholds in elements")
    parser.add_argument("--epochs", type=int, help="LEGACY: epochs the phases divide (iterations count as epochs)")
    args = parser.parse_args()
    if (args.legacy_by is None) != (args.group_compressions is None):
        parser.error("--legacy-by and --group-compressions go together")
    if args.fp16_allreduce:
        if args.compression != "none":
            parser.error(f"--fp16-allreduce is --compression fp16; got --compression {args.compression} too")
        args.compression = "fp16"
    return args


def build_compression(args: argparse.Namespace) -> Grace:
    name, _, value = args.compression.partition(":")
    parameter = (int(value) if value.isdigit() else float(value)) if value else None
    if args.legacy_by is None:
        compressor = compressor_from_name(name, parameter)
    else:
        if parameter is not None:
            raise SystemExit(f"--compression {args.compression}: a LEGACY schedule sets the parameter; drop ':{value}'")
        compressor = Legacy.from_flags(compressor_from_name(name, with_value=False), args.legacy_by,
                                         group_compressions=args.group_compressions,
                                         group_splits=args.group_splits, epochs=args.epochs)
    return Grace(compressor)


def main() -> None:
    args = parse_args()
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    device = "GPU" if cuda else "CPU"
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(1)

    model = getattr(models, args.model)()
    if cuda:
        model.cuda()
    compression = build_compression(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    if cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Compression: {compression!r}")
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    compression.reset_stats()

    log("Running benchmark...")
    img_secs = []
    for iteration in range(args.num_iters):
        compression.set_epoch(iteration)
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{iteration}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    rates = torch.tensor(img_secs, dtype=torch.float64)
    mean, conf = rates.mean().item(), 1.96 * rates.std(unbiased=False).item()
    log(f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    stats = compression.stats
    steps = args.num_iters * args.num_batches_per_iter
    log(f"Bytes sent per step per {device}: {stats['bytes_sent'] / steps / 1e6:.3f} MB of "
        f"{stats['bytes_dense'] / steps / 1e6:.3f} MB dense (volume {stats['volume']:.2%})")


if __name__ == "__main__":
    main()
