"""Start-up stays light: ``import dtrain`` and ``--version``/``--help`` do not load torch, and the command
line does not load what only some runs use (rich's live bar, matplotlib, TensorBoard, DALI, safetensors)."""
from __future__ import annotations

import subprocess
import sys


def modules_after(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('MODULES', *sys.modules)"],
                          capture_output=True, text=True, timeout=300, check=True)
    return set(done.stdout.split("MODULES ", 1)[1].split())


def test_import_dtrain_loads_no_torch_until_a_name_is_used():
    assert "torch" not in modules_after("import dtrain")
    used = modules_after("import dtrain\nassert dtrain.training_session.__name__ == 'TrainingSession'")
    assert {"torch", "dtrain.session.session"} <= used


def test_version_and_help_answer_without_torch_or_hydra():
    for flag in ("--version", "--help"):
        loaded = modules_after(f"import sys, runpy\nsys.argv = ['dtrain', '{flag}']\n"
                               f"try:\n    runpy.run_module('dtrain', run_name='__main__')\nexcept SystemExit:\n    pass")
        assert not {"torch", "hydra"} & loaded, flag


def test_the_command_line_module_loads_no_optional_heavy_package():
    loaded = modules_after("import dtrain.cli")
    assert not {"rich", "matplotlib", "tensorboard", "nvidia.dali", "safetensors", "optuna"} & loaded
