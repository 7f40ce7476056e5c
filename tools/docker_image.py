"""Build the CPU image and run it: ``make docker`` (and ``make test``, through tools/run_tests.py).

Steps, each timed:

1. the engine: ``docker`` when a Docker daemon answers, else ``podman`` (installed from Debian's
   packages with ``runc`` and ``debootstrap`` when missing and this is root), with
   ``docker/containers.conf`` for this kind of machine;
2. the base image ``debian:bookworm``: present, or pulled, or, where no registry answers, made
   with ``debootstrap --variant=minbase`` from the Debian mirror apt already uses here, imported
   and tagged with the name Docker Hub gives it, so ``FROM debian:bookworm`` finds it locally;
3. the wheelhouse (``make wheelhouse``: every wheel the image installs, Horovod's from the build
   cache), unless ``--online``, so the build needs no PyPI;
4. ``build`` of ``docker/Dockerfile`` (the layer cache makes later builds quick);
5. inside a container: ``--check`` (``horovodrun --check-build`` and the 2-rank smoke test) and
   the demo's fast mode (``--fast``, the race) on 4 ranks;
6. with ``--oci PATH``, the image saved as an OCI archive (for ``apptainer build x.sif
   oci-archive://PATH``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "localhost/hvd_averaging:cpu"
BASE = "debian:bookworm"
BASE_FULL_NAME = "docker.io/library/debian:bookworm"


class StepFailed(RuntimeError):
    pass


def run(argv, *, env=None, timeout=None, capture=False, check=True) -> subprocess.CompletedProcess:
    print("+ " + " ".join(str(a) for a in argv), flush=True)
    proc = subprocess.run([str(a) for a in argv], env=env, cwd=ROOT, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if check and proc.returncode != 0:
        raise StepFailed(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} exited with {proc.returncode}"
                         + (f":\n{proc.stdout[-3000:]}" if capture else ""))
    return proc


def quiet_ok(argv, env=None, timeout=60) -> bool:
    try:
        return subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def choose_engine() -> tuple[str, dict]:
    env = dict(os.environ)
    if shutil.which("docker") and quiet_ok(["docker", "info"], timeout=20):
        return "docker", env
    if shutil.which("podman") is None:
        if os.geteuid() != 0:
            raise StepFailed("neither a Docker daemon nor podman is here, and installing podman "
                             "needs root (apt-get install podman runc debootstrap)")
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", "podman", "runc", "debootstrap"],
            env=dict(env, DEBIAN_FRONTEND="noninteractive"))
    env.setdefault("CONTAINERS_CONF", str(ROOT / "docker" / "containers.conf"))
    return "podman", env


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 .sources or one-line lists)."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.is_file() and path.suffix in (".list", ".sources", ""):
            texts.append(path.read_text())
    for text in texts:
        for uri in re.findall(r"^URIs:\s*(\S+)", text, re.M) + \
                re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            if "security" not in uri and uri.startswith(("http://", "https://")):
                return uri
    raise StepFailed("no Debian mirror found in apt's sources; give one with --mirror")


def ensure_base(engine: str, env: dict, mirror: str | None) -> str:
    if quiet_ok([engine, "image", "inspect", BASE], env=env) or \
            quiet_ok([engine, "image", "inspect", BASE_FULL_NAME], env=env):
        return "present"
    if quiet_ok([engine, "pull", BASE], env=env, timeout=120):
        return "pulled"
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise StepFailed(f"no {BASE} image, no registry, and debootstrap needs root and the "
                         "debootstrap package")
    mirror = mirror or debian_mirror()
    with tempfile.TemporaryDirectory(prefix="hva-rootfs-") as rootfs:
        run(["debootstrap", "--variant=minbase", "bookworm", rootfs, mirror], capture=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([engine, "import", "-", f"localhost/{BASE}"], stdin=tar.stdout,
                                  env=env, stdout=subprocess.PIPE, text=True)
        tar.wait()
        if imported.returncode != 0 or tar.returncode != 0:
            raise StepFailed("importing the debootstrap root file system failed")
    run([engine, "tag", f"localhost/{BASE}", BASE_FULL_NAME], env=env)
    return f"made with debootstrap from {mirror}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--online", action="store_true",
                        help="install from PyPI inside the build instead of the wheelhouse")
    parser.add_argument("--mirror", help="Debian mirror for debootstrap (default: apt's)")
    parser.add_argument("--oci", type=Path, help="also save the image as an OCI archive here")
    parser.add_argument("--no-demo", action="store_true", help="only --check in the container")
    args = parser.parse_args()
    timings: list[tuple[str, float]] = []

    def step(name, func):
        start = time.monotonic()
        print(f"\n=== docker image: {name}", flush=True)
        result = func()
        timings.append((name, time.monotonic() - start))
        print(f"=== {name}: {result or 'done'} ({timings[-1][1]:.0f} s)", flush=True)
        return result

    try:
        engine, env = choose_engine()
        timings.append(("engine", 0.0))
        print(f"=== engine: {engine}", flush=True)
        step(f"base image {BASE}", lambda: ensure_base(engine, env, args.mirror))
        build_args = []
        if not args.online:
            step("wheelhouse (make wheelhouse)", lambda: run(["make", "-s", "wheelhouse"]) and None)
            build_args = ["--build-arg", "WHEELHOUSE=docker/wheelhouse"]
        step("build", lambda: run([engine, "build", "-f", "docker/Dockerfile", "-t", IMAGE,
                                   *build_args, "."], env=env) and IMAGE)

        def check():
            out = run([engine, "run", "--rm", IMAGE, "--check"], env=env, capture=True).stdout
            print(out[-1500:], flush=True)
            if "smoke test on 2 ranks over MPI: ok" not in out:
                raise StepFailed("the smoke test inside the container did not report ok")
            return "smoke test on 2 ranks over MPI: ok"

        step("--check inside a container", check)
        if not args.no_demo:
            def demo():
                out = run([engine, "run", "--rm", "-e", "OUT=/tmp/demo", IMAGE, "demo", "--fast"],
                          env=env, capture=True).stdout
                # rank 0's lines, behind the launcher's [1,0]<stdout>: prefix
                table = [line[line.index("| "):] for line in out.splitlines() if "| " in line]
                print("\n".join(table) or out[-3000:], flush=True)
                if not any("hvd.DistributedOptimizer" in line for line in table):
                    raise StepFailed("the demo inside the container printed no results table")
                return f"results table with {sum('SGD' in r or 'DiLoCo' in r or 'hvd.' in r for r in table)} methods"

            step("demo --fast inside a container (4 ranks)", demo)
        if args.oci:
            args.oci.parent.mkdir(parents=True, exist_ok=True)
            step("OCI archive", lambda: run([engine, "save", "--format", "oci-archive", "-o",
                                             args.oci.resolve(), IMAGE], env=env) and str(args.oci))
    except (StepFailed, subprocess.TimeoutExpired) as error:
        print(f"docker image: FAILED: {error}", flush=True)
        return 1
    print("\ndocker image timings: " + ", ".join(f"{n} {s:.0f} s" for n, s in timings), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
