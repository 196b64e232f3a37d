"""PowerSGD's rounds under the DDP hook, with and without ``fuse_rounds``, under real torchrun (Gloo).

Two DDP instances of the same model, from the same seed and batches, one per setting, each with
DDP's buckets capped small so that the model spans several. At every step after the first (whose
registration checks are collectives of their own) the worker counts the allreduces the hook
issues and the buckets DDP hands over, and compares the two instances' synchronized gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import PowerSGD
from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of

#: DDP's bucket cap in MB: small, so that the test model spans several buckets.
BUCKET_MB = 0.002
STEPS = 4
#: PowerSGD's allreduce rounds: each goes as one allreduce per launch (one dtype).
ROUNDS = 2


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec = Recorder(args.out, rank)
    allreduces, buckets = [0], [0]
    real_all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):
        allreduces[0] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce  # the backend looks it up at every call; the real one runs
    runs = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = Net()
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        state = grace_legacy.ddp.register(ddp, PowerSGD(1), fuse_rounds=fuse)
        hook = grace_legacy.ddp.GraceState.exchange

        def counting_exchange(bucket, _hook=hook, _state=state):
            buckets[0] += 1
            return _hook(_state, bucket)

        state.exchange = counting_exchange  # grace_hook calls state.exchange
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gradients, counts = [], []
        for step in range(STEPS):
            optimizer.zero_grad()
            allreduces[0] = buckets[0] = 0
            loss_of(ddp, batch(step, rank)).backward()
            counts.append((allreduces[0], buckets[0]))
            gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
            optimizer.step()
        runs[fuse] = (gradients, counts)

    (fused, fused_counts), (per_bucket, per_bucket_counts) = runs[True], runs[False]
    for step in range(1, STEPS):
        issued, handed = fused_counts[step]
        rec.check(f"step {step}: the model spans several buckets", handed > 1, f"{handed} buckets")
        rec.check(f"step {step}: fused, one allreduce a round for every bucket together", issued == ROUNDS,
                  f"{issued} allreduces, {handed} buckets")
        issued, handed = per_bucket_counts[step]
        rec.check(f"step {step}: per bucket, one allreduce a round for each bucket", issued == ROUNDS * handed,
                  f"{issued} allreduces, {handed} buckets")
    for step in range(STEPS):
        for name, gradient in fused[step].items():
            # Two ranks: every element's sum has the same two terms either way (a + b = b + a).
            rec.equal(gradient, per_bucket[step][name], f"step {step}: {name}: fused equals per bucket")
    rec.write()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
