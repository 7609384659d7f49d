"""The supported torch versions live in one module (issues 14, 46): torch 2.11 to 2.13. SWIFT's exact
inverses refuse a torch whose optimizer code was not checked; outside the range jitckpt refuses at
the start (`jitckpt run` before any worker, a worker under torchrun), naming the range and the fix;
every supported version is one the suite passed on."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jitckpt import torch_compat
from jitckpt.swift import UpdateUndo
from jitckpt.torch_compat import UntestedTorchError, require_supported_torch, require_tested_torch, torch_version


def test_versions_are_read_as_major_minor():
    assert torch_version("2.13.0+cpu") == (2, 13)
    assert torch_version("2.14.0.dev20261101") == (2, 14)
    with pytest.raises(ValueError, match="cannot read a torch version"):
        torch_version("nightly")


def test_the_installed_torch_is_a_tested_one():
    """CI runs on the pinned torch: if this fails, the pin and the table disagree."""
    assert torch_version() in torch_compat.TESTED, torch.__version__
    require_tested_torch("SWIFT update-undo")
    require_supported_torch()


def test_the_range_is_2_11_to_2_13_and_pyproject_declares_it():
    assert sorted(torch_compat.TESTED) == [(2, 11), (2, 12), (2, 13)]
    assert torch_compat.PIP_SPEC == "torch>=2.11,<2.14" and torch_compat.RANGE == "2.11 to 2.13"
    assert '"torch>=2.11,<2.14"' in (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()


def test_update_undo_refuses_a_torch_outside_the_range(monkeypatch):
    monkeypatch.setattr(torch_compat, "TESTED", ((1, 0),))
    monkeypatch.setattr(torch_compat, "RANGE", "1.0 to 1.0")
    monkeypatch.setattr(torch_compat, "PIP_SPEC", "torch>=1.0,<1.1")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(UntestedTorchError, match=r"checked on torch 1\.0 to 1\.0 only.*Install 'torch>=1\.0,<1\.1'"):
        UpdateUndo(opt)


def test_versions_outside_the_range_are_refused_and_those_inside_pass():
    for outside in ("2.10.0", "2.14.0", "3.0.0"):
        with pytest.raises(UntestedTorchError, match=r"jitckpt supports torch 2\.11 to 2\.13, and this is torch "
                                                       r".*pip install 'torch>=2\.11,<2\.14'.*torchrun without jitckpt"):
            require_supported_torch(outside)
    for inside in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        require_supported_torch(inside)
    for inside in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        require_tested_torch("SWIFT update-undo", inside)


def test_jitckpt_run_refuses_a_torch_outside_the_range_before_starting_anything(monkeypatch, tmp_path, capsys):
    from jitckpt import cli

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr(torch_compat, "installed_torch", lambda: "2.14.0")
    rc = cli.main(["run", "--nproc-per-node", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), str(script)])
    err = capsys.readouterr().err
    assert rc == 2 and "jitckpt run: error: jitckpt supports torch 2.11 to 2.13, and this is torch 2.14" in err, err
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
