"""Recovery plugins are objects the core calls (issue 14), looked up by `--plugin` name."""
from __future__ import annotations

import pytest

from jitckpt import plugins
from jitckpt.plugins import LoggingPlugin, RecoveryPlugin, UndoPlugin


def test_names_give_plugin_objects_once_each():
    assert plugins.get(["undo", "undo"]) == (UndoPlugin(),)
    assert [p.recovery for p in plugins.get(("logging", "undo"))] == ["stage", "jit"]
    with pytest.raises(ValueError, match=r"unknown plugin\(s\) \['cache'\]; known: undo, logging"):
        plugins.get(["undo", "cache"])


def test_protect_calls_each_plugins_hook(monkeypatch):
    """jitckpt.protect() hands its state to every plugin of the runtime, whatever it is named."""
    import torch

    import jitckpt
    from jitckpt.runtime import current
    from jitckpt.runtime.worker_runtime import WorkerRuntime
    from jitckpt.hang_timeout import HangTimeout

    seen = []

    class Probe(RecoveryPlugin):
        name = "probe"

        def on_protect(self, state, runtime):
            seen.append((type(state).__name__, runtime))

    rt = WorkerRuntime(rank=0, world_size=1, gen=0, checkpoint_dir="/nonexistent", channel=None,
                       hang_timeout=HangTimeout())
    rt.plugins = (Probe(), LoggingPlugin())
    monkeypatch.setattr(current, "_runtime", rt)
    model = torch.nn.Linear(2, 2)
    jitckpt.protect(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert seen == [("Protected", rt)]
