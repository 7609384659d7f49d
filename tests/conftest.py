import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("PYTHONPATH", str(ROOT))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT

# CI runs the property-based tests on a fixed sequence of examples, so a run is reproducible.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass
