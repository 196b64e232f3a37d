"""Compression set-ups for the state tests (issue 7): every valid compressor/memory pair, the
schedules and the non-default communicators, each as a label and a factory of a fresh ``Grace``."""

from __future__ import annotations

from collections.abc import Callable

from grace_legacy import (
    DGC,
    EF21,
    FP16,
    QSGD,
    Accordion,
    Broadcast,
    DGCMemory,
    DGCWarmup,
    EFSignSGD,
    EFSignSGDMemory,
    Grace,
    Legacy,
    LGreCo,
    Natural,
    NoCompression,
    NoMemory,
    OneBit,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    SignSGD,
    Signum,
    TernGrad,
    Threshold,
    TopK,
)

#: The workers' SGD learning rate, which EF-signSGD's memory must share.
LR = 0.05

Setup = tuple[str, Callable[[], Grace]]

COMPRESSORS: dict[str, Callable] = {
    "NoCompression": NoCompression,
    "FP16": FP16,
    "TopK(0.1)": lambda: TopK(0.1),
    "RandomK(0.1)": lambda: RandomK(0.1, seed=1),
    "DGC(0.1)": lambda: DGC(0.1, seed=2, min_samples=16),
    "Threshold(0.02)": lambda: Threshold(0.02),
    "QSGD(4)": lambda: QSGD(4, seed=3),
    "TernGrad": lambda: TernGrad(seed=4),
    "Natural": lambda: Natural(seed=5),
    "SignSGD": SignSGD,
    "Signum(0.9)": lambda: Signum(0.9),
    "OneBit": OneBit,
    "PowerSGD(2)": lambda: PowerSGD(2, seed=6),
    "EFSignSGD": lambda: EFSignSGD(LR),
}

MEMORIES: dict[str, Callable] = {
    "NoMemory": NoMemory,
    "Residual": Residual,
    "EF21": EF21,
    "DGCMemory": lambda: DGCMemory(0.9),
    "PowerSGDMemory": PowerSGDMemory,
    "EFSignSGDMemory": lambda: EFSignSGDMemory(LR),
}


#: Memories paired with one compressor only: with any other they are Residual again.
OWN_MEMORY = {"PowerSGDMemory": "PowerSGD", "EFSignSGDMemory": "EFSignSGD"}


def _accepts(make_compressor: Callable, make_memory: Callable) -> bool:
    try:
        Grace(make_compressor(), memory=make_memory())
    except ValueError:
        return False
    return True


def every_pair() -> list[Setup]:
    """Each compressor with every memory it accepts (EF-signSGD only takes its own memory,
    DGC's memory only sparsifiers), PowerSGDMemory with PowerSGD and EFSignSGDMemory with
    EF-signSGD only (elsewhere they are Residual again); then schedules and communicators."""
    setups: list[Setup] = []
    for c_label, make_c in COMPRESSORS.items():
        for m_label, make_m in MEMORIES.items():
            owner = OWN_MEMORY.get(m_label)
            if owner is not None and not c_label.startswith(owner):
                continue
            if _accepts(make_c, make_m):
                setups.append((f"{c_label}+{m_label}", lambda c=make_c, m=make_m: Grace(c(), memory=m())))
    return setups + SCHEDULES + COMMUNICATORS


SCHEDULES: list[Setup] = [
    ("Legacy(TopK) by both+Residual", lambda: Grace(Legacy(
        TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]], splits=[100], epochs=2, steps_per_epoch=2),
        memory=Residual())),
    ("Legacy(QSGD) by layer", lambda: Grace(Legacy(QSGD(seed=7), by="layer", values=[None, 4, 16],
                                                   splits=[5, 500]))),
    ("Legacy(PowerSGD) by epoch+PowerSGDMemory", lambda: Grace(Legacy(
        PowerSGD(seed=8), by="epoch", values=[3, 1], epochs=2, steps_per_epoch=2), memory=PowerSGDMemory())),
    ("DGCWarmup(DGC)+DGCMemory", lambda: Grace(DGCWarmup(
        DGC(seed=9, min_samples=16), target=0.05, warmup_epochs=2, steps_per_epoch=1), memory=DGCMemory(0.9))),
    ("Accordion(TopK)+Residual", lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2),
                                               memory=Residual())),
    ("LGreCo(TopK)+Residual", lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=2),
                                            memory=Residual())),
]

COMMUNICATORS: list[Setup] = [
    ("TopK(0.1)+Residual via Broadcast", lambda: Grace(TopK(0.1), memory=Residual(), communicator=Broadcast())),
    ("Threshold(0.02)+Residual via Broadcast", lambda: Grace(Threshold(0.02), memory=Residual(),
                                                             communicator=Broadcast())),
    ("RandomK(0.1)+EF21, one collective per tensor", lambda: Grace(RandomK(0.1, seed=10), memory=EF21(),
                                                                   bucket_bytes=0)),
]

#: What exact resume is tested on: each kind of state a run carries (residuals, step counters of
#: stochastic compressors, warm starts, momenta, EF21's estimates, a schedule's position and its
#: adaptive decisions). Checkpoints are taken after RESUME_AT of RESUME_STEPS steps.
RESUME_SETUPS: list[Setup] = [
    ("Legacy(TopK) by epoch+Residual", lambda: Grace(Legacy(
        TopK(), by="epoch", values=[0.3, 0.1, 0.02], epochs=3, steps_per_epoch=2), memory=Residual())),
    ("QSGD(4)", lambda: Grace(QSGD(4, seed=3))),
    ("RandomK(0.1)+Residual", lambda: Grace(RandomK(0.1, seed=1), memory=Residual())),
    ("PowerSGD(2)+PowerSGDMemory", lambda: Grace(PowerSGD(2, seed=6), memory=PowerSGDMemory())),
    ("DGC(0.1)+DGCMemory", lambda: Grace(DGC(0.1, seed=2, min_samples=16), memory=DGCMemory(0.9))),
    ("TopK(0.1)+EF21", lambda: Grace(TopK(0.1), memory=EF21())),
    ("Signum(0.9)", lambda: Grace(Signum(0.9))),
    ("EFSignSGD", lambda: Grace(EFSignSGD(LR))),
    ("Accordion(TopK)+Residual", lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2),
                                               memory=Residual())),
    ("LGreCo(TopK)+Residual", lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=2),
                                            memory=Residual())),
]
RESUME_AT, RESUME_STEPS = 3, 6
