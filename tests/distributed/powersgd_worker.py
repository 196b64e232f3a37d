"""PowerSGD checks: the synchronized gradient equals an independent PowerSGD computed here from
every rank's gradient (modified Gram-Schmidt instead of QR, the test's own warm-start Q and
residuals), alone, with error feedback, with op=Sum, and under LEGACY's epoch-quartile ranks.

``--dtypes float32 float16 bfloat16`` trains the model in each dtype named, one after the other
(each check's name starts with its dtype's): PowerSGD factors in float32 and returns the
gradient's dtype, and the reference does the same."""

from __future__ import annotations

import hashlib

import horovod.torch as hvd
import torch

from grace_legacy import Grace, Legacy, NoMemory, PowerSGD, PowerSGDMemory
from tests.distributed.checks import Recorder, gather_from_ranks, mean_of, parse_args
from tests.distributed.harness import train_and_compare

SEED = 5


def seed_of(*parts) -> int:
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    columns = []
    for j in range(p.shape[1]):
        v = p[:, j].clone()
        for u in columns:
            v = v - (u @ v) * u
        columns.append(v / v.norm())
    return torch.stack(columns, dim=1)


class ReferencePowerSGD:
    """PowerSGD written out for the test, rank chosen per step by ``rank_at(step)``."""

    def __init__(self, rank_at, residual: bool, op=hvd.Average) -> None:
        self.rank_at, self.residual, self.op = rank_at, residual, op
        self.q: dict[str, torch.Tensor] = {}
        self.compressions: dict[str, int] = {}
        self.errors: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, grad: torch.Tensor, step: int) -> torch.Tensor:
        r = self.rank_at(step)
        m_w = grad + self.errors.get(name, torch.zeros_like(grad)) if self.residual else grad
        combine = mean_of if self.op == hvd.Average else (lambda ts: mean_of(ts) * len(ts))
        n = grad.shape[0] if grad.dim() else 1
        m = grad.numel() // n if n else 0
        if grad.dim() < 2 or (n + m) * r >= n * m:
            self.errors.pop(name, None)
            return combine(gather_from_ranks(m_w))
        matrix = m_w.reshape(n, m).to(torch.float64 if grad.dtype == torch.float64 else torch.float32)
        count = self.compressions.get(name, 0)
        self.compressions[name] = count + 1
        q = self.q.get(name)
        if q is None or q.shape != (m, r):
            q = torch.randn(m, r, generator=torch.Generator().manual_seed(seed_of(SEED, name, count)))
        p_hat = gram_schmidt(combine(gather_from_ranks(matrix @ q)))
        q_w = matrix.t() @ p_hat
        self.q[name] = combine(gather_from_ranks(q_w))
        if self.residual:
            self.errors[name] = m_w - (p_hat @ q_w.t()).reshape(grad.shape).to(grad.dtype)
        return (p_hat @ self.q[name].t()).reshape(grad.shape).to(grad.dtype)


def main() -> None:
    args = parse_args([(("--dtypes",), {"nargs": "+", "choices": ["float32", "float16", "bfloat16"],
                                        "default": ["float32"]})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    for name in args.dtypes:
        run_dtype(rec, getattr(torch, name), f"{name} ")
    rec.write()


def run_dtype(rec: Recorder, dtype: torch.dtype, prefix: str) -> None:
    """Every check in ``dtype``, each named after ``prefix``."""
    # In 16 bits the result is rounded to the dtype (and a dense sum's order is Horovod's): a few
    # units in its last place, against gradients of up to about 0.3.
    eps = torch.finfo(dtype).eps
    options = {"rtol": 1e-5, "atol": 1e-6, "dtype": dtype} if dtype == torch.float32 else \
        {"rtol": 4 * eps, "atol": eps / 4, "dtype": dtype}

    rec.guard(prefix + "powersgd r=2", train_and_compare, rec, prefix + "powersgd r=2",
              Grace(PowerSGD(2, seed=SEED), memory=NoMemory()), ReferencePowerSGD(lambda s: 2, residual=False),
              **options)
    rec.guard(prefix + "powersgd r=1 sum", train_and_compare, rec, prefix + "powersgd r=1 sum",
              Grace(PowerSGD(1, seed=SEED), memory=NoMemory()), ReferencePowerSGD(lambda s: 1, False, hvd.Sum),
              op=hvd.Sum, **options)
    default = PowerSGD(2, seed=SEED)
    rec.check(prefix + "powersgd recommends PowerSGDMemory", isinstance(Grace(default).memory, PowerSGDMemory))
    rec.guard(prefix + "powersgd r=2 + memory", train_and_compare, rec, prefix + "powersgd r=2 + memory", default,
              ReferencePowerSGD(lambda s: 2, residual=True), **options)

    # The rebuttal's PowerSGD schedule: epoch quartiles with ranks 6, 4, 3, 2 (one epoch per step).
    quartiles = [6, 4, 3, 2]
    schedule = Legacy(PowerSGD(seed=SEED), by="epoch", values=quartiles, epochs=4, steps_per_epoch=1)
    rank_by_rule = lambda step: quartiles[next(i for i in range(4) if step < (i + 1) * 4 / 4)]  # noqa: E731
    bundle = Grace(schedule, memory=PowerSGDMemory())
    rec.guard(prefix + "legacy powersgd quartiles", train_and_compare, rec, prefix + "legacy powersgd quartiles",
              bundle, ReferencePowerSGD(rank_by_rule, residual=True), steps=4, **options)
    rec.check(prefix + "legacy powersgd: every phase used", set(bundle.stats.get("phase", {})) == {0, 1, 2, 3},
              str(bundle.stats))

if __name__ == "__main__":
    main()
