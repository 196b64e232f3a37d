"""The example scripts run under real horovodrun with tiny flags and print the lines the README
quotes: the synthetic benchmark's img/sec and bytes sent (its volume what the planner predicts for
the same model and schedule), and the language model's validation perplexity and volume (matching
its uniform budget)."""

import re

import pytest

from grace_legacy import Legacy, TopK
from grace_legacy.planner import model_shapes, plan
from tests.distributed.launcher import REPO, run_script

pytestmark = pytest.mark.distributed

EXAMPLES = REPO / "examples"


@pytest.mark.smoke
def test_synthetic_benchmark_with_a_legacy_schedule():
    pytest.importorskip("torchvision.models")
    flags = ["--legacy-by", "layer", "--group-compressions", "100,1", "--group-splits", "10000"]
    result = run_script(EXAMPLES / "pytorch_synthetic_benchmark.py", 2, "gloo", "--model", "squeezenet1_1",
                        "--batch-size", "2", "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                        "--num-iters", "2", "--image-size", "64", "--compression", "topk", *flags, timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per CPU", out)) == 2, out[-3000:]
    assert re.search(r"Img/sec per CPU: [\d.]+ \+-[\d.]+", out), out[-3000:]
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+", out), out[-3000:]
    sent = re.search(r"Bytes sent per step per CPU: [\d.]+ MB of [\d.]+ MB dense \(volume ([\d.]+)%\)", out)
    assert sent, out[-3000:]
    schedule = Legacy.from_flags(TopK(), "layer", group_compressions="100,1", group_splits="10000")
    planned = plan(schedule, [shape for _, shape in model_shapes("torchvision:squeezenet1_1")], world_size=2)
    assert float(sent.group(1)) / 100 == pytest.approx(planned.volume, abs=5e-5)


def test_character_language_model_with_a_budget_matched_schedule():
    result = run_script(EXAMPLES / "train_charlm.py", 2, "mpi", "--epochs", "3", "--chars", "60000",
                        "--steps-per-epoch", "4", "--hidden", "32", "--batch-size", "4", "--seq-len", "32",
                        timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    assert len(re.findall(r"epoch \d: train loss [\d.]+, validation perplexity [\d.]+", out)) == 3, out[-3000:]
    last = re.search(r"validation perplexity ([\d.]+) \| 2 workers \| volume ([\d.]+)% "
                     r"\(uniform Top-k 1%: ([\d.]+)%\)", out)
    assert last, out[-3000:]
    perplexity, volume, budget = map(float, last.groups())
    assert 1 < perplexity < 256  # better than a uniform guess over bytes
    assert volume == pytest.approx(budget, rel=0.02)
