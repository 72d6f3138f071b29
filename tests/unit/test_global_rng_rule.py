"""The library never draws from the process's global random generators (Python's `random`,
NumPy's, torch's default one). They are the user's: `RNGState` carries them from a healthy
replica to a recovering one, and a draw made by the library on one replica only (a retry's
jitter, a request id) makes the replicas' states differ, so their snapshots disagree and a
catch-up striped over two sources fails on every step (seen: a recovering replica exhausting
`max_failed_commits`). Checked statically over every library module, and for the quorum
client's request ids at run time."""

from __future__ import annotations

import ast
import random
from pathlib import Path

from fthsdp.services.quorum import client as quorum_client

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("services", "worker", "protos")
RNG_STATE = ROOT / "worker" / "rng_state.py"
"""The one module that reads and restores the global generators, on purpose."""

_PYTHON_DRAWS = frozenset(
    {
        "random",
        "uniform",
        "randint",
        "randrange",
        "choice",
        "choices",
        "shuffle",
        "sample",
        "getrandbits",
        "gauss",
        "normalvariate",
        "expovariate",
        "triangular",
        "betavariate",
        "seed",
        "setstate",
    }
)
_TORCH_DRAWS = frozenset(
    {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
     "bernoulli", "multinomial", "manual_seed", "seed", "set_rng_state"}
)  # fmt: skip


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _global_draws(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        head, _, fn = name.rpartition(".")
        uses_own = any(k.arg == "generator" for k in node.keywords)
        if (
            (head == "random" and fn in _PYTHON_DRAWS)
            or (head in ("np.random", "numpy.random") and fn != "default_rng")
            or (head == "torch" and fn in _TORCH_DRAWS and not uses_own)
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}()")
    return found


def test_no_library_module_draws_from_the_global_generators() -> None:
    offenders = [
        hit
        for package in LIBRARY
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != RNG_STATE
        for hit in _global_draws(path)
    ]
    assert offenders == []


def test_the_rule_sees_each_kind_of_draw(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import random, torch\nimport numpy as np\n"
        "random.uniform(0, 1)\nnp.random.rand(3)\ntorch.randperm(4)\n"
        "torch.randperm(4, generator=g)\nrandom.Random().uniform(0, 1)\n"
    )
    hits = [hit.split(": ", 1)[1] for hit in _global_draws(sample, tmp_path)]
    assert hits == ["random.uniform()", "np.random.rand()", "torch.randperm()"]


def test_quorum_request_ids_leave_the_global_generator_alone() -> None:
    before = random.getstate()
    ids = {quorum_client._new_attempt_id() for _ in range(100)}
    assert random.getstate() == before
    assert len(ids) == 100 and all(i > 0 for i in ids)
