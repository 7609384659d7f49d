"""What jitckpt's processes say to each other, one module of typed messages per channel.

* :mod:`.wire` -- how a message travels (JSON with its type) and is decoded, strictly;
* :mod:`.control_messages` / :mod:`.control_channel` -- launcher <-> worker;
* :mod:`.keeper_messages` -- rank <-> its node's snapshot keeper;
* :mod:`.worker_spec` -- what the launcher tells a worker once, at its start;
* :mod:`.exit_codes` -- what a worker's exit code means to the launcher.
"""
