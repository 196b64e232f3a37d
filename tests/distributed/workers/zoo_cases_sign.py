"""Zoo cases for the sign family of issue 4: signSGD, Signum, EF-signSGD and 1-bit SGD."""

from zoo import Case, majority_vote_rule, mean_rule
from zoo_cases_core import pair

from grace_legacy import EFSignSGD, EFSignSGDMemory, NoMemory, OneBit, Residual, SignSGD, Signum

#: The worker's SGD learning rate, which EF-signSGD's memory must share.
LR = 0.05


CASES = [
    Case("SignSGD", lambda: pair(SignSGD, NoMemory), rule=majority_vote_rule, routes={"allgather"}),
    Case("Signum(0.9)", lambda: pair(lambda: Signum(0.9), NoMemory), rule=majority_vote_rule,
         routes={"allgather"}),
    Case("EFSignSGD+EFSignSGDMemory", lambda: pair(lambda: EFSignSGD(LR), lambda: EFSignSGDMemory(LR)),
         rule=mean_rule, routes={"allgather"}),  # the twin memory's aggregated() divides by lr
    Case("OneBit+Residual", lambda: pair(OneBit, Residual), rule=mean_rule, routes={"allgather"}),
]
