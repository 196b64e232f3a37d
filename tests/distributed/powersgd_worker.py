"""PowerSGD checks: the synchronized gradient equals an independent PowerSGD computed here from
every rank's gradient (modified Gram-Schmidt instead of QR, the test's own warm-start Q and
residuals), alone, with error feedback, with op=Sum, and under LEGACY's epoch-quartile ranks."""

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
        matrix = m_w.reshape(n, m)
        count = self.compressions.get(name, 0)
        self.compressions[name] = count + 1
        q = self.q.get(name)
        if q is None or q.shape != (m, r):
            q = torch.randn(m, r, generator=torch.Generator().manual_seed(seed_of(SEED, name, count)))
        p_hat = gram_schmidt(combine(gather_from_ranks(matrix @ q)))
        q_w = matrix.t() @ p_hat
        self.q[name] = combine(gather_from_ranks(q_w))
        if self.residual:
            self.errors[name] = (matrix - p_hat @ q_w.t()).reshape(grad.shape)
        return (p_hat @ self.q[name].t()).reshape(grad.shape)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    tolerance = {"rtol": 1e-5, "atol": 1e-6}

    rec.guard("powersgd r=2", train_and_compare, rec, "powersgd r=2", Grace(PowerSGD(2, seed=SEED), memory=NoMemory()),
              ReferencePowerSGD(lambda s: 2, residual=False), **tolerance)
    rec.guard("powersgd r=1 sum", train_and_compare, rec, "powersgd r=1 sum",
              Grace(PowerSGD(1, seed=SEED), memory=NoMemory()), ReferencePowerSGD(lambda s: 1, False, hvd.Sum),
              op=hvd.Sum, **tolerance)
    default = PowerSGD(2, seed=SEED)
    rec.check("powersgd recommends PowerSGDMemory", isinstance(Grace(default).memory, PowerSGDMemory))
    rec.guard("powersgd r=2 + memory", train_and_compare, rec, "powersgd r=2 + memory", default,
              ReferencePowerSGD(lambda s: 2, residual=True), **tolerance)

    # The rebuttal's PowerSGD schedule: epoch quartiles with ranks 6, 4, 3, 2 (one epoch per step).
    quartiles = [6, 4, 3, 2]
    schedule = Legacy(PowerSGD(seed=SEED), by="epoch", values=quartiles, epochs=4, steps_per_epoch=1)
    rank_by_rule = lambda step: quartiles[next(i for i in range(4) if step < (i + 1) * 4 / 4)]  # noqa: E731
    rec.guard("legacy powersgd quartiles", train_and_compare, rec, "legacy powersgd quartiles",
              Grace(schedule, memory=PowerSGDMemory()), ReferencePowerSGD(rank_by_rule, residual=True),
              steps=4, **tolerance)
    rec.check("legacy powersgd: every phase used", set(schedule.stats.get("phase", {})) == {0, 1, 2, 3},
              str(schedule.stats))
    rec.write()


if __name__ == "__main__":
    main()
