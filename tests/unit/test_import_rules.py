"""The import rules of DESIGN.md, checked statically (every import in every module) and at runtime
(importing a service's entry points must not drag torch in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("quorum", "checkpoint", "health")
TORCH_FREE = ("quorum", "health")
TOP_LEVEL = ("protos", "services", "worker", "deploy", "bench")
"""The repository's package directories; installed, each is `fthsdp.<name>`."""


def _raw_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _imports(path: Path) -> list[str]:
    """The modules `path` imports, with the installed `fthsdp.` namespace prefix removed."""
    return [name.removeprefix("fthsdp.") for name in _raw_imports(path)]


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _is_client(module: str) -> bool:
    """A service's client modules or its domain (the objects and errors its clients and servers
    share), or services.common (shared helpers that hold no service)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[:2] == ["services", "common"]:
        return True
    if len(parts) < 3 or parts[0] != "services":
        return False
    return parts[2].startswith("client") or parts[2] == "domain"


@pytest.mark.parametrize("service", TORCH_FREE)
def test_torch_free_services_never_import_torch(service: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _modules(f"services/{service}")
        for name in _imports(path)
        if name == "torch" or name.startswith("torch.") or name.startswith("worker")
    ]
    assert offenders == []


def test_worker_imports_only_service_clients() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _modules("worker")
        for name in _imports(path)
        if name.startswith("services.") and name.count(".") >= 2 and not _is_client(name)
    ]
    assert offenders == []


@pytest.mark.parametrize("service", SERVICES)
def test_services_talk_to_each_other_only_through_clients(service: str) -> None:
    offenders = []
    for path in _modules(f"services/{service}"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "services" or len(parts) < 3 or parts[1] == service:
                continue
            if not _is_client(name):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


@pytest.mark.parametrize("service", TORCH_FREE)
def test_importing_a_torch_free_service_loads_no_torch(service: str) -> None:
    modules = [
        "fthsdp." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in _modules(f"services/{service}")
    ]
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_worker_library_leaves_dtensor_unimported_until_a_user_shards() -> None:
    """`torch.distributed.tensor` costs each rank process about 0.6 s of CPU at every start;
    only a job that uses FSDP2 (which imports it) needs it (`worker/dtensor.py`)."""
    code = (
        "import sys, fthsdp, fthsdp.worker.manager, fthsdp.worker.state\n"
        "sys.exit(1 if 'torch.distributed.tensor' in sys.modules else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_code_imports_the_project_only_through_the_fthsdp_namespace() -> None:
    """The repository's directories install as `fthsdp.<dir>`; a bare `import worker` would
    work in a checkout and break when installed (and load a second copy of the module)."""
    paths = [p for d in (*TOP_LEVEL, "tests") for p in _modules(d)]
    paths += sorted((ROOT / "examples").rglob("*.py"))
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in paths
        if "_pb2" not in path.name
        for name in _raw_imports(path)
        if name.split(".")[0] in TOP_LEVEL
    ]
    assert offenders == []


def test_the_checker_sees_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom fthsdp.services.quorum.server import QuorumServer\n")
    names = _imports(bad)
    assert "torch" in names
    assert "services.quorum.server.QuorumServer" in names
    assert not _is_client("services.quorum.server.QuorumServer")
    assert _is_client("services.quorum.client.QuorumClient")
    assert _is_client("services.quorum.domain.Quorum")
    assert not _is_client("services.quorum.core.Registration")
