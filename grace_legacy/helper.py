"""GRACE's ``grace_from_params``: the dictionary a GRACE training script already builds, read into
a :class:`~grace_legacy.Grace` bundle.

The keys and defaults are GRACE's:

* ``compressor`` (``"none"``): one of :data:`COMPRESSORS`;
* ``memory`` (``"none"``): one of :data:`MEMORIES`;
* ``communicator`` (``"allreduce"``): one of :data:`COMMUNICATORS`. Ours besides GRACE's:
  ``"default"``, the route of the compressor's own aggregation per tensor (``Grace``'s default:
  an allreduce for additive payloads, an allgather otherwise, dense where that is cheaper);
  ``"scattergather"``, the two-phase compressed allreduce; ``"auto"``, the route of fewest link
  bytes per tensor, two-phase included (``Grace(communicator="auto")``);
* ``compress_ratio`` (``0.3``): the density of topk, randomk and dgc, and adaq's share of each sign;
* ``quantum_num`` (``127``): qsgd's levels;
* ``threshold`` (``0.01``): threshold's magnitude;
* ``momentum`` (``0.9``): signum's momentum, and the dgc memory's;
* ``lr`` (``0.1``): efsignsgd's learning rate (compressor and memory);
* ``compress_rank`` (``1``): powersgd's rank;
* ``error_bound`` (``2e-10``): inceptionn's bound on the absolute error. GRACE's TensorFlow code
  reads the bound's exponent as ``int(log10(error_bound / 2))`` and so, with this default, drops
  every value below ``2**-10``; here the bound is what it says, and ``2e-10`` keeps nearly every
  value, most of them in full. Pass ``2**-10`` for what GRACE's default did;
* ``quantiles`` (``64``): sketch's number of buckets;
* ``gradient_clipping`` (``False``): the dgc memory's clipping norm (``False`` or ``None``: none);
* ours, for the LEGACY reference's own compressors: ``bin_size`` (``50``), adacomp's bins;
  ``var_alpha`` (``2.0``) and ``var_ksi`` (``0.999``), variance's test and decay (the reference's
  flags); ``cat_c0`` (``1.0``), ``cat_c1`` (``60.0``) and ``packet_bits`` (``1460``), cat's cost
  model (the reference's defaults). ``variance`` needs the model's per-sample moments:
  ``bundle.compressor.attach(model)`` (``.base.attach`` under LEGACY keys);
* ``world_size``: ignored (GRACE needed it; the backend knows the number of ranks), but checked:
  ``None`` or a positive integer.

Four more keys, those of the LEGACY reference implementation, turn on a LEGACY schedule of the
compressor's parameter (:meth:`Legacy.from_flags`): ``legacy_by`` (``"uniform"``, ``"layer"``,
``"epoch"`` or ``"both"``), ``group_compressions`` (percent for a density), ``group_splits`` and
``epochs``. The schedule then sets the parameter, so ``compress_ratio`` (or ``quantum_num``,
``threshold``, ``compress_rank``) is not used.

The compressor names are GRACE's, from its PyTorch and TensorFlow sides (``adaq``, ``inceptionn``,
``sketch`` and ``u8bit`` are TensorFlow's), plus ``bf16`` (:class:`~grace_legacy.BF16`), which GRACE
lacks, and the LEGACY reference's ``globaltopk``, ``cat``, ``adacomp`` and ``variance``.

GRACE accepted combinations that silently corrupt the gradient, such as a sparse payload summed by
``"allreduce"``; here they raise ``ValueError`` naming the communicator to use instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

from grace_legacy.communicators import Allgather, Allreduce, Broadcast, ScatterGather
from grace_legacy.compressors import (
    BF16,
    CAT,
    DGC,
    FP16,
    INCEPTIONN,
    QSGD,
    AdaComp,
    AdaQ,
    EFSignSGD,
    GlobalTopK,
    Natural,
    NoCompression,
    OneBit,
    PowerSGD,
    RandomK,
    SignSGD,
    Signum,
    Sketch,
    TernGrad,
    Threshold,
    TopK,
    U8bit,
    VarianceSparsifier,
)
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Tunable
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.grace import AUTO, Grace
from grace_legacy.memories import DGCMemory, EFSignSGDMemory, PowerSGDMemory, Residual
from grace_legacy.runtime.validation import ArgumentTypeError, check_positive_int, is_int
from grace_legacy.schedules.legacy import Legacy

#: GRACE's keys with GRACE's defaults.
DEFAULTS: dict[str, Any] = {
    "compressor": "none", "memory": "none", "communicator": "allreduce",
    "compress_ratio": 0.3, "quantum_num": 127, "threshold": 0.01, "momentum": 0.9, "lr": 0.1,
    "compress_rank": 1, "gradient_clipping": False, "world_size": None, "error_bound": 2e-10, "quantiles": 64,
    "bin_size": 50, "var_alpha": 2.0, "var_ksi": 0.999, "cat_c0": 1.0, "cat_c1": 60.0, "packet_bits": 1460,
}
#: The LEGACY reference implementation's flags.
LEGACY_KEYS = ("legacy_by", "group_compressions", "group_splits", "epochs")

# Each compressor: how to build it from the parameters, with its parameter (``parameter=True``) or without
# it, for LEGACY to set.
_Build = Callable[[Mapping[str, Any], bool], Compressor]
COMPRESSORS: dict[str, _Build] = {
    "none": lambda p, parameter: NoCompression(),
    "fp16": lambda p, parameter: FP16(),
    "topk": lambda p, parameter: TopK(p["compress_ratio"] if parameter else None),
    "randomk": lambda p, parameter: RandomK(p["compress_ratio"] if parameter else None),
    "dgc": lambda p, parameter: DGC(p["compress_ratio"] if parameter else None),
    "threshold": lambda p, parameter: Threshold(p["threshold"] if parameter else None),
    "qsgd": lambda p, parameter: QSGD(p["quantum_num"] if parameter else None),
    "terngrad": lambda p, parameter: TernGrad(),
    "natural": lambda p, parameter: Natural(),
    "signsgd": lambda p, parameter: SignSGD(),
    "signum": lambda p, parameter: Signum(p["momentum"]),
    "efsignsgd": lambda p, parameter: EFSignSGD(p["lr"]),
    "onebit": lambda p, parameter: OneBit(),
    "powersgd": lambda p, parameter: PowerSGD(p["compress_rank"] if parameter else None),
    "adaq": lambda p, parameter: AdaQ(p["compress_ratio"] if parameter else None),
    "inceptionn": lambda p, parameter: INCEPTIONN(p["error_bound"] if parameter else None),
    "sketch": lambda p, parameter: Sketch(p["quantiles"] if parameter else None),
    "u8bit": lambda p, parameter: U8bit(),
    "bf16": lambda p, parameter: BF16(),
    "globaltopk": lambda p, parameter: GlobalTopK(p["compress_ratio"] if parameter else None),
    "cat": lambda p, parameter: CAT(p["cat_c0"], p["cat_c1"], p["packet_bits"]),
    "adacomp": lambda p, parameter: AdaComp(p["bin_size"] if parameter else None),
    "variance": lambda p, parameter: VarianceSparsifier(p["var_alpha"] if parameter else None, p["var_ksi"]),
}
#: The key that sets each compressor's parameter (the parameter LEGACY schedules).
PARAMETER_KEYS = {"topk": "compress_ratio", "randomk": "compress_ratio", "dgc": "compress_ratio",
                  "threshold": "threshold", "qsgd": "quantum_num", "powersgd": "compress_rank",
                  "adaq": "compress_ratio", "inceptionn": "error_bound", "sketch": "quantiles",
                  "globaltopk": "compress_ratio", "adacomp": "bin_size", "variance": "var_alpha"}
MEMORIES: dict[str, Callable[[Mapping[str, Any]], Memory]] = {
    "none": lambda p: NoMemory(),
    "residual": lambda p: Residual(),
    # GRACE's gradient_clipping=False (or None) is no clipping; any other value is the norm, which
    # DGCMemory checks (a 0 or a string is refused, not read as False).
    "dgc": lambda p: DGCMemory(p["momentum"], clip=None if p["gradient_clipping"] is False
                               else p["gradient_clipping"]),
    "efsignsgd": lambda p: EFSignSGDMemory(p["lr"]),
    "powersgd": lambda p: PowerSGDMemory(),
}
COMMUNICATORS: dict[str, Callable[[], Communicator | str | None]] = {
    "allreduce": Allreduce, "allgather": Allgather, "broadcast": Broadcast, "scattergather": ScatterGather,
    "default": lambda: None, "auto": lambda: AUTO,
}
#: The keys each compressor and memory reads besides its name: an error of theirs names them.
_KEYS_READ = {
    "compressor": {**{name: (key,) for name, key in PARAMETER_KEYS.items()}, "signum": ("momentum",),
                   "efsignsgd": ("lr",), "cat": ("cat_c0", "cat_c1", "packet_bits"),
                   "variance": ("var_alpha", "var_ksi")},
    "memory": {"dgc": ("momentum", "gradient_clipping"), "efsignsgd": ("lr",)},
}


def _built(params: Mapping[str, Any], kind: str, build: Callable[[], Any]) -> Any:
    """``build()``, whose argument errors name the keys of ``params`` they came from."""
    try:
        return build()
    except (TypeError, ValueError) as err:
        keys = _KEYS_READ[kind].get(params[kind], ())
        given = ", ".join(f"{key}={params[key]!r}" for key in keys)
        where = f"grace_from_params: {kind}={params[kind]!r}" + (f" with {given}" if given else "")
        error = ArgumentTypeError if isinstance(err, TypeError) else ValueError
        raise error(f"{where}: {err}") from None


def _choice(params: Mapping[str, Any], key: str, table: Mapping[str, Any]) -> Any:
    name = params[key]
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"grace_from_params: {key}={name!r} is not known; accepted: {', '.join(map(repr, table))}")
    return table[name]


def compressor_from_name(name: str, value: Any = None, *, with_value: bool = True) -> Compressor:
    """The compressor GRACE calls ``name``, at parameter ``value`` (GRACE's default when ``None``), or
    without its parameter (``with_value=False``) for a schedule to set."""
    if not isinstance(name, str) or name not in COMPRESSORS:
        raise ValueError(f"compressor {name!r} is not known; accepted: {', '.join(map(repr, COMPRESSORS))}")
    params = dict(DEFAULTS)
    if value is not None:
        if name not in PARAMETER_KEYS:
            raise ValueError(f"compressor {name!r} has no parameter to set; these have one: "
                             f"{', '.join(PARAMETER_KEYS)}")
        params[PARAMETER_KEYS[name]] = value
    return COMPRESSORS[name](params, with_value)


def _legacy(base: Compressor, params: Mapping[str, Any]) -> Legacy:
    given = {key: params[key] for key in LEGACY_KEYS if key in params}
    for needed in ("legacy_by", "group_compressions"):
        if needed not in given:
            raise ValueError(f"grace_from_params: LEGACY keys {sorted(given)} need {needed!r} too; a LEGACY "
                             f"schedule is given by {', '.join(LEGACY_KEYS)} (legacy_by and group_compressions "
                             f"required)")
    by = given["legacy_by"]
    if by not in ("uniform", *Legacy.MODES):
        raise ValueError(f"grace_from_params: legacy_by={by!r} is not known; accepted: 'uniform', "
                         f"{', '.join(map(repr, Legacy.MODES))}")
    if base.parameter is None:
        raise ValueError(f"grace_from_params: compressor={params['compressor']!r} has no parameter for LEGACY "
                         f"to schedule; use one of "
                         f"{', '.join(repr(n) for n, make in COMPRESSORS.items() if make(DEFAULTS, False).parameter)}")
    compressions = given["group_compressions"]
    if not isinstance(compressions, (str, numbers.Real)) or isinstance(compressions, (bool, torch.Tensor)):
        raise ArgumentTypeError(f"grace_from_params: group_compressions must be a string (comma-separated values, "
                                f"';' between phases) or a number, got {compressions!r} of type "
                                f"{type(compressions).__name__}")
    splits = given.get("group_splits", "")
    if isinstance(splits, (list, tuple)) and all(is_int(s) for s in splits):
        splits = ",".join(str(int(s)) for s in splits)
    if not isinstance(splits, str):
        raise ArgumentTypeError(f"grace_from_params: group_splits must be a comma-separated string or a list of "
                                f"integers, got {splits!r} of type {type(splits).__name__}")
    # epochs goes to Legacy as given, which refuses what is not a positive integer (int() would
    # have made 1.5 or True an epoch count of 1).
    return Legacy.from_flags(base, by, group_compressions=str(compressions), group_splits=splits,
                               epochs=given.get("epochs"))


def grace_from_params(params: Mapping[str, Any]) -> Grace:
    """A :class:`~grace_legacy.Grace` bundle from GRACE's parameter dictionary (keys, defaults
    and LEGACY's extra keys in the module docstring).

    Raises ``ValueError`` for an unknown key or name (listing the accepted ones), for a value
    out of range (naming the key) and for a combination that would compute a wrong gradient
    (naming what to use instead); ``TypeError`` (also a ``ValueError``) for a value of the wrong
    type.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"grace_from_params: params must be a dict, got {type(params).__name__}")
    unknown = sorted(set(params) - set(DEFAULTS) - set(LEGACY_KEYS), key=str)
    if unknown:
        raise ValueError(f"grace_from_params: unknown key(s) {', '.join(map(repr, unknown))}; accepted: "
                         f"{', '.join(map(repr, [*DEFAULTS, *LEGACY_KEYS]))}")
    full = {**DEFAULTS, **params}
    if full["world_size"] is not None:  # unused, but a wrong one is still a mistake worth naming
        check_positive_int(full["world_size"], "world_size", "grace_from_params")
    scheduled = any(key in params for key in LEGACY_KEYS)
    build = _choice(full, "compressor", COMPRESSORS)
    make_memory = _choice(full, "memory", MEMORIES)
    make_communicator = _choice(full, "communicator", COMMUNICATORS)
    compressor = _built(full, "compressor", lambda: build(full, not scheduled))
    if scheduled:
        compressor = _legacy(compressor, params)
    else:  # a parameter of None: the error names the key to set
        if isinstance(compressor, Tunable):
            _built(full, "compressor", compressor.check_ready)
    memory = _built(full, "memory", lambda: make_memory(full))
    communicator = make_communicator()
    try:
        return Grace(compressor, memory, communicator)
    except ValueError as err:
        if (not isinstance(communicator, Communicator) or communicator.carries_non_additive
                or compressor.traits.additive):
            raise ValueError(f"grace_from_params: {err}") from None
        raise ValueError(f"grace_from_params: {err}; in params, set 'communicator': 'allgather' or 'default' "
                         f"(GRACE's result: every rank's payload gathered), 'scattergather' (two-phase: owners "
                         f"re-compress each shard's sum) or 'auto' (the fewest link bytes per tensor)") from None
