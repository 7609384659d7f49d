"""The supported torch versions live in one module (issue 14): SWIFT's exact inverses refuse a torch
they were not transcribed from and tested on; the rest of jitckpt warns once."""
from __future__ import annotations

import logging

import pytest
import torch

from jitckpt import torch_compat
from jitckpt.swift import UpdateUndo
from jitckpt.torch_compat import UntestedTorchError, require_tested_torch, torch_version, warn_if_untested


def test_versions_are_read_as_major_minor():
    assert torch_version("2.13.0+cpu") == (2, 13)
    assert torch_version("2.14.0.dev20261101") == (2, 14)
    with pytest.raises(ValueError, match="cannot read a torch version"):
        torch_version("nightly")


def test_the_installed_torch_is_a_tested_one():
    """CI runs on the pinned torch: if this fails, the pin and TESTED disagree."""
    assert torch_version() in torch_compat.TESTED, torch.__version__
    require_tested_torch("SWIFT update-undo")


def test_update_undo_refuses_an_untested_torch(monkeypatch):
    monkeypatch.setattr(torch_compat, "TESTED", ((2, 12),))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(UntestedTorchError, match=r"tested on torch 2\.12 only.*Install torch==2\.12\.\*"):
        UpdateUndo(opt)


def test_untested_versions_warn_once_and_too_old_ones_are_refused(monkeypatch, caplog):
    monkeypatch.setattr(torch_compat, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="jitckpt.torch_compat"):
        warn_if_untested("2.14.0")
        warn_if_untested("2.14.0")
    assert [r.getMessage() for r in caplog.records] == [
        "torch 2.14 is not among the versions jitckpt is tested on (2.13); recovery may misbehave "
        "where torch's internals changed"]
    with pytest.raises(UntestedTorchError, match=r"needs torch >= 2\.4, this is torch 2\.3"):
        warn_if_untested("2.3.1")
