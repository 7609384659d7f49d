"""The released framework versions an integration is built and tested against."""
from __future__ import annotations

import re
from importlib import metadata


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string ("5.24.0.dev0" -> (5, 24, 0)): enough for a range
    check, without a dependency on ``packaging`` for users who lack the framework itself."""
    m = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else (0,)


def require(dist: str, *, extra: str, at_least: str, below: str) -> str:
    """The installed version of ``dist``; ImportError naming it and the fix when missing or outside
    [at_least, below)."""
    fix = f"pip install 'jitckpt[{extra}]'"
    try:
        found = metadata.version(dist)
    except metadata.PackageNotFoundError:
        raise ImportError(f"jitckpt.integrations.{extra} needs {dist} (>={at_least},<{below}), which is not "
                          f"installed: {fix}") from None
    if not _release(at_least) <= _release(found) < _release(below):
        raise ImportError(f"jitckpt.integrations.{extra} supports {dist} >={at_least},<{below}; this is {dist} "
                          f"{found}: {fix} installs a supported one")
    return found
