"""``grace_from_params`` reads GRACE's parameter dictionary (GRACE's keys and defaults, plus the
LEGACY reference flags) into a ``Grace`` bundle, and refuses unknown names and combinations that
would corrupt the gradient with errors that say what to use."""

import pytest
import torch

import grace_legacy
from grace_legacy import (
    BF16,
    DGC,
    FP16,
    INCEPTIONN,
    QSGD,
    AdaComp,
    AdaQ,
    Allreduce,
    Broadcast,
    DGCMemory,
    EFSignSGD,
    EFSignSGDMemory,
    GlobalTopK,
    Grace,
    Legacy,
    NoCompression,
    NoMemory,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    Signum,
    Sketch,
    Threshold,
    TopK,
    U8bit,
    VarianceSparsifier,
    grace_from_params,
)
from grace_legacy.helper import COMMUNICATORS, COMPRESSORS, MEMORIES


def test_defaults_are_gracess_no_compression_no_memory_allreduce():
    grc = grace_from_params({})
    assert isinstance(grc, Grace)
    assert isinstance(grc.compressor, NoCompression)
    assert isinstance(grc.memory, NoMemory)
    assert isinstance(grc.communicator, Allreduce)


@pytest.mark.parametrize(("params", "kind", "parameter"), [
    ({"compressor": "topk", "communicator": "allgather"}, TopK, 0.3),
    ({"compressor": "randomk", "communicator": "allgather"}, RandomK, 0.3),
    ({"compressor": "dgc", "communicator": "allgather"}, DGC, 0.3),
    ({"compressor": "threshold", "communicator": "allgather"}, Threshold, 0.01),
    ({"compressor": "qsgd", "communicator": "allgather"}, QSGD, 127),
    ({"compressor": "powersgd"}, PowerSGD, 1),
    ({"compressor": "topk", "communicator": "allgather", "compress_ratio": 0.01}, TopK, 0.01),
    ({"compressor": "qsgd", "communicator": "allgather", "quantum_num": 64}, QSGD, 64),
    ({"compressor": "powersgd", "compress_rank": 4}, PowerSGD, 4),
    # GRACE's TensorFlow side: its keys and defaults.
    ({"compressor": "adaq", "communicator": "allgather"}, AdaQ, 0.3),
    ({"compressor": "adaq", "communicator": "allgather", "compress_ratio": 0.05}, AdaQ, 0.05),
    ({"compressor": "inceptionn", "communicator": "allgather"}, INCEPTIONN, 2e-10),
    ({"compressor": "inceptionn", "communicator": "allgather", "error_bound": 2**-10}, INCEPTIONN, 2**-10),
    ({"compressor": "sketch", "communicator": "allgather"}, Sketch, 64),
    ({"compressor": "sketch", "communicator": "allgather", "quantiles": 256}, Sketch, 256),
    # The LEGACY reference's own compressors: their keys (ours) and defaults.
    ({"compressor": "globaltopk", "communicator": "allgather", "compress_ratio": 0.01}, GlobalTopK, 0.01),
    ({"compressor": "adacomp", "communicator": "allgather"}, AdaComp, 50),
    ({"compressor": "variance", "communicator": "allgather", "var_alpha": 1.5}, VarianceSparsifier, 1.5),
])
def test_each_parameter_takes_gracess_key_and_default(params, kind, parameter):
    grc = grace_from_params(params)
    assert type(grc.compressor) is kind
    assert grc.compressor.value == parameter


def test_cat_takes_its_cost_model_and_refuses_a_bad_one_by_key():
    assert repr(grace_from_params({"compressor": "cat", "communicator": "allgather", "cat_c0": 576, "cat_c1": 64,
                                   "packet_bits": 512}).compressor) == "CAT(c0=576.0, c1=64.0, packet_bits=512)"
    with pytest.raises(ValueError, match="packet_bits=0"):
        grace_from_params({"compressor": "cat", "communicator": "allgather", "packet_bits": 0})
    with pytest.raises(ValueError, match="one selection over every layer"):
        grace_from_params({"compressor": "globaltopk", "communicator": "allgather", "legacy_by": "layer",
                           "group_compressions": "100,1", "group_splits": "1000"})


def test_every_name_gracess_helper_knows_builds_a_bundle():
    assert set(COMPRESSORS) == {"none", "fp16", "topk", "randomk", "dgc", "threshold", "qsgd", "terngrad",
                                "natural", "signsgd", "signum", "efsignsgd", "onebit", "powersgd",
                                "adaq", "inceptionn", "sketch", "u8bit", "bf16", "globaltopk", "cat", "adacomp",
                                "variance"}
    assert set(MEMORIES) == {"none", "residual", "dgc", "efsignsgd", "powersgd"}
    assert set(COMMUNICATORS) == {"allreduce", "allgather", "broadcast", "scattergather", "default", "auto"}
    for name in COMPRESSORS:
        memory = "efsignsgd" if name == "efsignsgd" else "none"
        communicator = "allreduce" if name in ("none", "fp16", "bf16", "powersgd") else "allgather"
        grc = grace_from_params({"compressor": name, "memory": memory, "communicator": communicator,
                                 "world_size": 4})
        assert isinstance(grc, Grace)
    assert isinstance(grace_from_params({"compressor": "fp16"}).compressor, FP16)
    assert isinstance(grace_from_params({"compressor": "bf16"}).compressor, BF16)
    assert isinstance(grace_from_params({"compressor": "u8bit", "communicator": "allgather"}).compressor, U8bit)
    assert isinstance(grace_from_params({"compressor": "topk", "communicator": "broadcast"}).communicator,
                      Broadcast)


def test_memories_take_gracess_keys():
    grc = grace_from_params({"compressor": "dgc", "memory": "dgc", "communicator": "allgather",
                             "momentum": 0.5, "gradient_clipping": 2.0})
    assert isinstance(grc.memory, DGCMemory) and grc.memory.momentum == 0.5 and grc.memory.clip == 2.0
    assert grace_from_params({"compressor": "dgc", "memory": "dgc", "communicator": "allgather"}).memory.clip is None
    grc = grace_from_params({"compressor": "efsignsgd", "memory": "efsignsgd", "communicator": "allgather",
                             "lr": 0.05})
    assert isinstance(grc.compressor, EFSignSGD) and isinstance(grc.memory, EFSignSGDMemory)
    assert grc.compressor.lr == grc.memory.lr == 0.05
    assert isinstance(grace_from_params({"compressor": "powersgd", "memory": "powersgd"}).memory, PowerSGDMemory)
    assert isinstance(grace_from_params({"compressor": "topk", "memory": "residual",
                                         "communicator": "allgather"}).memory, Residual)
    assert grace_from_params({"compressor": "signum", "communicator": "allgather",
                              "momentum": 0.8}).compressor.momentum == 0.8
    assert isinstance(grace_from_params({"compressor": "signum", "communicator": "allgather"}).compressor, Signum)


@pytest.mark.parametrize(("params", "named"), [
    ({"compressor": "topkk"}, "'topk'"),
    ({"memory": "ef"}, "'residual'"),
    ({"communicator": "alltoall"}, "'allgather'"),
    ({"compresion_ratio": 0.1}, "'compress_ratio'"),
])
def test_unknown_names_and_keys_list_what_is_accepted(params, named):
    with pytest.raises(ValueError, match="accepted") as err:
        grace_from_params(params)
    assert named in str(err.value)


@pytest.mark.parametrize("compressor", ["topk", "dgc", "threshold", "qsgd", "terngrad", "natural",
                                        "signsgd", "signum", "onebit"])
def test_gathered_payload_through_allreduce_is_refused_naming_allgather(compressor):
    with pytest.raises(ValueError, match="'communicator': 'allgather' or 'default'") as err:
        grace_from_params({"compressor": compressor})
    assert "sums payloads" in str(err.value)  # Grace's own explanation comes first
    assert "'auto'" in str(err.value) and "'scattergather'" in str(err.value)


@pytest.mark.parametrize(("word", "expected"), [("default", "None"), ("auto", "'auto'")])
def test_the_default_and_auto_words_build_those_bundles(word, expected):
    bundle = grace_from_params({"compressor": "topk", "communicator": word})
    assert bundle.communicator is None and bundle.configuration()["communicator"] == expected


def test_legacy_keys_build_the_reference_schedule():
    grc = grace_from_params({"compressor": "topk", "memory": "residual", "communicator": "allgather",
                             "legacy_by": "both", "group_compressions": "100,10,1;10,1,0.1",
                             "group_splits": "1000,100000", "epochs": 90})
    schedule = grc.compressor
    assert isinstance(schedule, Legacy)
    assert schedule.by == "both" and schedule.splits == [1000, 100000] and schedule.epochs == 90
    assert schedule.table == [[1.0, 0.1, 0.01], [0.1, 0.01, 0.001]]
    assert schedule.to_flags() == {"by": "both", "group_compressions": "100,10,1;10,1,0.1",
                                     "group_splits": "1000,100000", "epochs": 90}
    qsgd = grace_from_params({"compressor": "qsgd", "communicator": "allgather", "legacy_by": "epoch",
                              "group_compressions": "4,16", "epochs": 10}).compressor
    assert qsgd.table == [[4], [16]]


def test_legacy_keys_schedule_adaqs_share_and_sketchs_buckets():
    adaq = grace_from_params({"compressor": "adaq", "communicator": "auto", "legacy_by": "layer",
                              "group_compressions": "100,30,5", "group_splits": "1000,100000"}).compressor
    assert isinstance(adaq, Legacy) and isinstance(adaq.base, AdaQ)
    assert adaq.table == [[1.0, 0.3, 0.05]] and adaq.splits == [1000, 100000]
    sketch = grace_from_params({"compressor": "sketch", "communicator": "auto", "legacy_by": "epoch",
                                "group_compressions": "256,64,16", "epochs": 9}).compressor
    assert isinstance(sketch, Legacy) and isinstance(sketch.base, Sketch)
    assert sketch.table == [[256], [64], [16]]
    assert sketch.value_for(torch.zeros(10), "w") == 256


@pytest.mark.parametrize(("params", "message"), [
    ({"compressor": "topk", "communicator": "allgather", "group_compressions": "1"}, "'legacy_by'"),
    ({"compressor": "topk", "communicator": "allgather", "legacy_by": "layer"}, "'group_compressions'"),
    ({"compressor": "topk", "communicator": "allgather", "legacy_by": "size", "group_compressions": "1"},
     "'uniform', 'layer', 'epoch', 'both'"),
    ({"compressor": "signsgd", "communicator": "allgather", "legacy_by": "layer", "group_compressions": "1"},
     "'topk'"),
])
def test_incomplete_or_wrong_legacy_keys_are_refused(params, message):
    with pytest.raises(ValueError) as err:
        grace_from_params(params)
    assert message in str(err.value)


def test_design_card_names():
    assert grace_legacy.LegacyCompressor is Legacy
    assert grace_legacy.grace_from_params is grace_from_params
    assert {"LegacyCompressor", "grace_from_params"} <= set(grace_legacy.__all__)


def test_compressor_from_name_sets_the_parameter_or_leaves_it_to_a_schedule():
    from grace_legacy.helper import compressor_from_name

    assert compressor_from_name("topk").ratio == 0.3
    assert compressor_from_name("topk", 0.01).ratio == 0.01
    assert compressor_from_name("qsgd", 16).levels == 16
    assert compressor_from_name("powersgd", with_value=False).value is None
    with pytest.raises(ValueError, match="has no parameter to set"):
        compressor_from_name("signsgd", 1)
    with pytest.raises(ValueError, match="accepted: 'none'"):
        compressor_from_name("top-k")
