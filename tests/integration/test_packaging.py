"""The distribution as a user installs it: one top-level name, `fthsdp`, in a fresh venv; the
public API, the service entry points and the console scripts work from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("fthsdp", "protos", "services", "worker", "deploy", "bench")

pytestmark = pytest.mark.timeout(300)


def _site_packages(venv: Path) -> Path:
    [path] = (venv / "lib").glob("python3*/site-packages")
    return path


def test_the_wheel_installs_only_the_fthsdp_name_into_a_fresh_venv(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *PACKAGE_DIRS):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(source)],
        check=True, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    [wheel] = dist.glob("fthsdp-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = _site_packages(venv)
    before = set(os.listdir(site))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, cwd=tmp_path, timeout=120)
    added = set(os.listdir(site)) - before
    assert {name for name in added if not name.endswith(".dist-info")} == {"fthsdp"}
    version = wheel.name.split("-")[1]
    assert [name for name in added if name.endswith(".dist-info")] == [
        f"fthsdp-{version}.dist-info"
    ]

    # Dependencies come from this test's environment, after the fresh venv's own site-packages
    # (a plain path entry: its .pth files, the editable install among them, are not run).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import fthsdp, importlib.util, sys\n"
        f"assert fthsdp.__file__.startswith({str(site)!r}), fthsdp.__file__\n"
        "assert fthsdp.Manager.__module__ == 'fthsdp.worker.manager'\n"
        "assert fthsdp.ExactlyOnceDataLoader and fthsdp.OptimizerWrapper and fthsdp.RNGState\n"
        "import fthsdp.services.quorum.__main__, fthsdp.protos.quorum_pb2_grpc\n"
        "for bare in ('worker', 'services', 'deploy', 'protos', 'bench'):\n"
        "    assert importlib.util.find_spec(bare) is None, bare\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-c", code], check=True, cwd=tmp_path, env=env, timeout=120)
    for script in ("fthsdp", "fthsdp-quorum", "fthsdp-checkpoint", "fthsdp-health"):
        result = subprocess.run(
            [str(venv / "bin" / script), "--help"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, (script, result.stderr[-2000:])


def test_the_public_api_names_what_it_exports() -> None:
    import fthsdp

    assert sorted(fthsdp.__all__) == sorted(fthsdp._EXPORTS)
    for name in fthsdp.__all__:
        assert getattr(fthsdp, name) is not None
    with pytest.raises(AttributeError):
        _ = fthsdp.NotAThing  # type: ignore[attr-defined]
