"""What a run prints and logs is readable: ``make run``'s script under a real horovodrun (no terminal)
prints plain progress lines, not tqdm's carriage-return redraws; the TensorBoard example under a
real torchrun writes ``compression.scalars()`` to an event file, the numbers the run printed."""

import re

import pytest

from tests.distributed.launcher import REPO, TORCHRUN, free_port, run_command, run_script

pytestmark = pytest.mark.distributed

EXAMPLES = REPO / "examples"


def test_make_run_prints_one_plain_progress_line_at_a_time():
    result = run_script(EXAMPLES / "train_digits.py", 2, "gloo", "--epochs", "3", "--progress-every", "0",
                        timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    out = result.stdout
    assert "\r" not in out and "epochs:" not in out, out[-3000:]
    progress = re.findall(r"^\[0\]<stdout>:epoch (\d)/3 \| loss \d+\.\d{3} \| \d+\.\d s$", out, re.MULTILINE)
    assert progress == ["1", "2", "3"], out[-3000:]
    assert not re.search(r"^\[1\]<stdout>:epoch", out, re.MULTILINE)  # rank 0 alone reports
    assert re.search(r"test accuracy \d+\.\d+% \| 2 workers \| rank 0 sent", out), out[-3000:]


def test_make_run_thins_its_progress_lines_to_one_per_interval():
    result = run_script(EXAMPLES / "train_digits.py", 2, "gloo", "--epochs", "3", "--progress-every", "3600",
                        timeout=400)
    assert result.returncode == 0, result.stdout[-6000:]
    # Within the hour only the last epoch's line: the run's end is always shown.
    assert re.findall(r"<stdout>:epoch (\d)/3", result.stdout) == ["3"], result.stdout[-3000:]


def test_the_tensorboard_example_logs_the_scalars(tmp_path):
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(EXAMPLES / "tensorboard_scalars.py"), "--epochs", "2", "--logdir", str(tmp_path / "runs")]
    result = run_command(cmd, 400)
    assert result.returncode == 0, result.stdout[-6000:]
    printed = [float(v) / 100 for v in re.findall(r"epoch \d/2 \| loss [\d.]+ \| volume ([\d.]+)%", result.stdout)]
    assert len(printed) == 2, result.stdout[-3000:]

    events = tensorboard.EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "grace/volume", "grace/wire_bytes", "grace/bytes_sent", "grace/group/0/volume",
                "grace/group/2/volume", "grace/phase/0/volume", "grace/phase/1/volume"):
        assert tag in tags, sorted(tags)
    volume = events.Scalars("grace/volume")
    assert [point.step for point in volume] == [0, 1]
    for point, shown in zip(volume, printed, strict=True):
        assert 0 < point.value < 1 and point.value == pytest.approx(shown, abs=5e-5)
    # Stats are reset after each epoch's point: phase 0 is epoch 0's, phase 1 epoch 1's.
    assert [p.step for p in events.Scalars("grace/phase/0/volume")] == [0]
    assert [p.step for p in events.Scalars("grace/phase/1/volume")] == [1]
    assert [p.step for p in events.Scalars("train/loss")] == [0, 1]
