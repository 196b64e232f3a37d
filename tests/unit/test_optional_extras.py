"""Lightning, Accelerate and TensorBoard are optional extras: ``pip install grace-legacy[lightning]``
(``[accelerate]``, ``[tensorboard]``), installed by ``make setup`` with the torch pin that keeps the
CPU torch. The core package needs none of them: with their imports failing (in a subprocess, so this
process's own imports do not interfere) ``grace_legacy``, ``grace_legacy.ddp`` and ``scalars()`` work,
and ``grace_legacy.lightning`` fails with the install line to type. The strategies refuse another hook."""

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTRAS = {"lightning": "lightning", "accelerate": "accelerate", "tensorboard": "tensorboard"}

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys

    BLOCKED = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "tensorboard", "tensorboardX")


    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None


    sys.meta_path.insert(0, Blocker())
    import grace_legacy
    import grace_legacy.ddp
    from grace_legacy import Grace, TopK

    assert Grace(TopK(0.1)).scalars()["grace/volume"] == 0.0
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    try:
        import grace_legacy.lightning  # noqa: F401
    except ImportError as error:
        print("refused:", error)
    else:
        raise SystemExit("grace_legacy.lightning imported without lightning")
""")


def test_the_core_package_needs_none_of_the_extras(tmp_path):
    script = tmp_path / "no_extras.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=REPO,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused: grace_legacy.lightning needs the lightning package: pip install 'grace-legacy[lightning]'" \
        in result.stdout, result.stdout


def test_each_extra_is_declared_and_installed_by_make_setup_with_the_torch_pin():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in EXTRAS.items():
        assert any(requirement.startswith(package) for requirement in extras[extra]), (extra, extras[extra])
    setup = (REPO / "scripts" / "setup.sh").read_text()
    install = next(line for line in setup.replace("\\\n", " ").splitlines() if "pip install" in line and "-e" in line)
    assert '--constraint "$ROOT/scripts/constraints.txt"' in install, install
    for extra in EXTRAS:
        assert extra in install.split("-e", 1)[1], (extra, install)
    pins = [line for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert pins == ["torch==2.13.0"]


def test_the_strategies_refuse_a_hook_of_their_own_and_bad_compression():
    lightning_module = pytest.importorskip("grace_legacy.lightning")
    from grace_legacy import Grace, TopK

    for strategy in (lightning_module.GraceDDPStrategy, lightning_module.GraceFabricStrategy):
        with pytest.raises(ValueError, match="ddp_comm_hook would install another communication hook"):
            strategy(TopK(0.1), ddp_comm_hook=lambda state, bucket: None)
        with pytest.raises(ValueError, match="ddp_comm_state, ddp_comm_wrapper"):
            strategy(TopK(0.1), ddp_comm_state=object(), ddp_comm_wrapper=print)
        with pytest.raises(TypeError, match=f"{strategy.__name__}: compression must be a grace_legacy compressor"):
            strategy("topk")
        bundle = Grace(TopK(0.1))
        built = strategy(bundle, find_unused_parameters=True)
        assert built.grace is bundle and built.grace_state is None
        assert built.scalars() == bundle.scalars() and built.stats == bundle.stats
