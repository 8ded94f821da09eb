"""``lmrl``'s launcher (``lightning_mcore_rl_launcher``): the top-level help without importing
Lightning, torch or the package (issue 37 item 8: ``lmrl --help`` took ~10 s), the same
subcommands as the real CLI, and every other command handed to ``lightning_mcore_rl.cli``."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

import lightning_mcore_rl.cli as cli_module
import lightning_mcore_rl_launcher as launcher
from lightning_mcore_rl.rank_errors import ALL_TRACEBACKS_ENV

HEAVY = ("lightning", "lightning_fabric", "torch", "megatron", "lightning_mcore_rl", "jsonargparse")

_PROBE = """
import json, sys
import lightning_mcore_rl_launcher as launcher
code = launcher.main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def _probe(*args: str) -> tuple[dict[str, object], str, str]:
    """Run the launcher in a fresh interpreter: (its result and the heavy modules it imported,
    stdout, stderr without the result line)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    *err, result = done.stderr.strip().splitlines()
    return json.loads(result), done.stdout, "\n".join(err)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_help_lists_every_subcommand_without_importing_lightning_or_torch(flag: str):
    result, out, err = _probe(flag)
    assert result == {"code": 0, "heavy": []}, result
    assert err == ""
    assert out.startswith("usage: lmrl [-h] [-c CONFIG] [--print_config[=flags]] "
                          "{fit,validate,test,predict} ...")  # fmt: skip
    for name in ("fit", "validate", "test", "predict", "export"):
        assert f"\n  {name:<10} " in out, (name, out)
    assert "`lmrl fit --help`" in out and "lmrl export --ckpt DIR" in out


def test_no_arguments_print_the_help_and_a_usage_error():
    result, out, err = _probe()
    assert result == {"code": 2, "heavy": []}, result
    assert out == ""
    assert err.startswith("usage: lmrl ")
    assert err.endswith(
        "lmrl: error: a subcommand is required (fit, validate, test, predict, export)."
    )


def test_the_launcher_says_what_the_real_cli_runs():
    assert list(launcher.LIGHTNING_SUBCOMMANDS) == list(LightningCLI.subcommands())
    assert launcher.DESCRIPTION == cli_module.DESCRIPTION
    assert ALL_TRACEBACKS_ENV in launcher.DESCRIPTION


def test_the_console_script_is_the_launcher():
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="lmrl")
    assert script.value == "lightning_mcore_rl_launcher:main"
    installed = Path(sys.executable).parent / "lmrl"
    if installed.exists():  # the venv's script (absent where the package is not installed)
        done = subprocess.run([installed, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == launcher.help_text(), done.stderr


def test_anything_else_goes_to_the_real_cli(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["export", "--help"])  # lightning_mcore_rl.cli.main's export subcommand
    assert exit_info.value.code == 0
    assert "--hf-source" in capsys.readouterr().out
