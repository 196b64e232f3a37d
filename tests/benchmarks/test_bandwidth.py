"""The bandwidth report's accounting of Top-k's time above its bound: the floor (the bound plus the
passes Top-k + EF makes in every step) and the CPU time each rank spends beyond compute-only's."""

from benchmarks.performance.bandwidth import cpu_sentence, floor_sentence, passes_clause

PASSES = {"add": 0.02, "select": 0.03, "clear": 0.01, "total": 0.055}


def test_the_floor_is_the_bound_plus_the_slowest_ranks_passes_together():
    sentence = floor_sentence({"topk_passes_s": PASSES}, {"bound_s": 0.5}, 1.2)
    assert "0.055 s together" in sentence and "1.11x its bound" in sentence  # (0.5 + 0.055) / 0.5
    assert "leaves 0.045 s of the 1.2x target's budget" in sentence  # 1.2 * 0.5 - 0.555


def test_passes_that_exceed_the_budget_are_said_to_be_past_the_target():
    sentence = floor_sentence({"topk_passes_s": PASSES}, {"bound_s": 0.2}, 1.15)
    assert "1.27x its bound" in sentence and "0.025 s past the 1.15x target before every tensor's hooks" in sentence
    assert "leaves" not in sentence


def test_the_last_collectives_fixed_cost_at_the_rate_joins_the_floor():
    record = {"topk_passes_s": PASSES, "tiny_allgather_s": {repr(1e8): 0.005, repr(1e9): 0.002}}
    sentence = floor_sentence(record, {"bound_s": 0.5}, 1.2)
    assert "1.11x its bound on this machine; with the wait for the last bucket's collective" in sentence
    assert "(0.005 s), 1.12x" in sentence  # (0.5 + 0.055 + 0.005) / 0.5
    assert "leaves 0.040 s of the 1.2x target's budget for everything else (every tensor's hooks and the " \
           "scatter-add)" in sentence


def test_each_pass_is_named_with_its_time():
    clause = passes_clause({"topk_passes_s": PASSES})
    assert "add 0.020 s" in clause and "selection 0.030 s" in clause and "dense result 0.010 s" in clause


def test_a_report_from_before_the_passes_were_timed_reads_as_it_did():
    record = {"topk_compress_s": 0.029}
    assert floor_sentence(record, {"bound_s": 0.4}, 1.15) == ""
    assert passes_clause(record) == ("the Top-k selection alone takes about 0.029 s, measured apart with all "
                                     "ranks at once")


COMPUTE = {"cpu_s": 0.15, "main_thread_cpu_s": 0.14}
TOP_K = {"cpu_s": 0.23, "main_thread_cpu_s": 0.2}


def test_cpu_beyond_compute_is_split_between_the_training_thread_and_the_others():
    sentence = cpu_sentence(TOP_K, COMPUTE, workers=4, cores=2)
    assert "0.230 s of CPU against compute-only's 0.150 s" in sentence
    assert "+0.080 s, +0.060 s of it in the training thread and +0.020 s in Horovod's" in sentence
    assert "with 4 ranks on 2 cores that is about 0.160 s of wall time" in sentence


def test_with_a_core_per_rank_no_wall_time_is_claimed():
    assert "wall time" not in cpu_sentence(TOP_K, COMPUTE, workers=4, cores=4)


def test_a_report_from_before_cpu_time_was_measured_says_nothing_of_it():
    assert cpu_sentence({"step_s": 0.4}, {"step_s": 0.3}, workers=4, cores=None) == ""
