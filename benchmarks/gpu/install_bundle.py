"""Install, from the bundle of benchmarks/gpu/bundle.sh and nothing else (no package index), what this Python lacks
of benchmarks/gpu/bundle.txt and DeepSpeed 0.19.x, into SITE (which check.sh puts first on PYTHONPATH, its bin/ on
PATH); then import everything the GPU check imports and print the versions found. The standard library only: it
runs before anything is installed.

A package counts as present when its distribution is installed and importable, at least at ``MINIMUM`` (a version
below it is replaced from the bundle), and DeepSpeed when it is 0.19.x; a pydantic from the bundle comes with the
pydantic-core it pins. Exit status 1, naming them, when the bundle lacks a file it needs or an import fails.

    python benchmarks/gpu/install_bundle.py BUNDLE_DIR SITE_DIR
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
# (major, minor) below which a present package is replaced: what DeepSpeed 0.19.8 (pydantic >= 2) and pydantic 2.14
# require, and a setuptools that builds DeepSpeed's wheel without the ``wheel`` package (70.1)
MINIMUM = {"pydantic": (2, 0), "typing-extensions": (4, 14), "annotated-types": (0, 6), "typing-inspection": (0, 4),
           "packaging": (20, 0), "setuptools": (70, 1)}
# What the GPU check imports (its benchmarks, DeepSpeed's CPU Adam build, the plugin), checked once installed.
IMPORTS = ("torch", "deepspeed", "deepspeed.ops.adam", "deepspeed.moe.layer", "pydantic", "hjson", "einops", "msgpack",
           "numpy", "packaging", "psutil", "cpuinfo", "tqdm", "ninja", "setuptools", "ds_pseudo_real.offload",
           "ds_pseudo_real.controller")


def pinned() -> Dict[str, str]:
    """{distribution: version} of bundle.txt."""
    lines = (line.strip() for line in (HERE / "bundle.txt").read_text().splitlines())
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def installed(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def major_minor(version: str) -> tuple:
    return tuple(int(part) for part in version.split(".")[:2])


def needed(packages: Dict[str, str]) -> List[str]:
    """The distributions of ``packages`` and deepspeed to take from the bundle."""
    take = [dist for dist in packages
            if installed(dist) is None or major_minor(installed(dist)) < MINIMUM.get(dist, (0, 0))]
    if "pydantic" in take and "pydantic-core" not in take:  # pydantic pins the exact pydantic-core it runs on
        take.append("pydantic-core")
    deepspeed = installed("deepspeed")
    if deepspeed is None or major_minor(deepspeed) != (0, 19):
        take.append("deepspeed")
    return take


def bundle_file(bundle: Path, dist: str, version: str) -> Optional[Path]:
    stem = dist.replace("-", "_").lower()
    for path in sorted(bundle.iterdir()):
        name = path.name.lower().replace("-", "_")
        if name.startswith(f"{stem}_{version}") and name.endswith((".whl", ".tar.gz")):
            return path
    return None


def pip(*args: str, env: Optional[Dict[str, str]] = None) -> None:
    """pip with no package index: nothing but the files named."""
    subprocess.run([sys.executable, "-m", "pip", *args[:1], "-q", "--no-index", "--no-deps", "--no-cache-dir",
                    "--disable-pip-version-check", *args[1:]], check=True, env=env)


def deepspeed_wheel(archive: Path, setuptools: Optional[Path], scratch: Path) -> Path:
    """DeepSpeed's wheel built from its source archive with this torch (no build isolation: the build imports it),
    with the bundle's setuptools when the machine lacks a usable one."""
    env = dict(os.environ)
    if setuptools is not None:
        pip("install", "--target", str(scratch / "build"), str(setuptools))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch / "build"), env.get("PYTHONPATH")]))
    pip("wheel", "--no-build-isolation", "--wheel-dir", str(scratch), str(archive), env=env)
    return next(scratch.glob("deepspeed-*.whl"))


def main(argv: List[str]) -> int:
    bundle, site = Path(argv[0]), Path(argv[1])
    packages = pinned()
    take = needed(packages)
    present = [f"{dist} {installed(dist)}" for dist in [*packages, "deepspeed"] if dist not in take]
    print(f"present: {', '.join(present) or 'none'}")
    versions = {**packages, "deepspeed": "0.19.8"}
    files = {dist: bundle_file(bundle, dist, versions[dist]) if bundle.is_dir() else None for dist in take}
    lacking = [f"{dist}=={versions[dist]}" for dist, path in files.items() if path is None]
    if lacking:
        print(f"the bundle {bundle} lacks {', '.join(lacking)}: run benchmarks/gpu/bundle.sh "
              f"{sys.version_info[0]}.{sys.version_info[1]} {bundle} where pip reaches the package index")
        return 1
    if take:
        print(f"installing from {bundle} into {site}: {', '.join(f'{d}=={versions[d]}' for d in take)}")
        with tempfile.TemporaryDirectory() as scratch:
            if "deepspeed" in files:
                files["deepspeed"] = deepspeed_wheel(files["deepspeed"], files.get("setuptools"), Path(scratch))
            # one install, so that every package's scripts (ninja's, for torch's extension builds) land in site/bin
            pip("install", "--no-compile", "--upgrade", "--target", str(site), *map(str, files.values()))
        importlib.invalidate_caches()
    failed = []
    for module in IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - every failure is reported by name
            failed.append(f"{module} ({type(error).__name__}: {error})")
    if failed:
        print("cannot import: " + "; ".join(failed))
        return 1
    import torch

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}), "
          + ", ".join(f"{dist} {installed(dist)}" for dist in ("deepspeed", "pydantic", "numpy", "ninja")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
