"""The layers of ``ddpx/``: every module imports only from the layers below its own.

The core chain reads bottom to top: errors -> markers -> hookspecs -> imports
-> plugin manager -> config -> core plugin -> trainer; beside it sit leaves
that only need the errors (networking, SLURM, kernels, data, models) and,
above the trainer, the programs built from it (launcher, worker, doctor, smoke
run, benchmarks, CLI commands). Every import counts, also one inside a
function (those exist to keep ``ddpx --version`` from importing torch, never to
dodge a cycle); imports under ``if TYPE_CHECKING:`` are for annotations only.

A new module must be given a layer here: the test fails for a module it does not know.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ddpx"

# Bottom first. A module may import from strictly lower layers only; the parts of one
# package (ddpx.comm_hooks.int8 -> ddpx.comm_hooks.base) may import each other.
LAYERS = [
    ["errors", "version", "_C", "seeding", "rank_log"],
    ["markers", "net", "slurm", "monitor", "models", "data", "ops", "batchnorm", "checkpoint", "losses", "stopping",
     "runlock", "compile"],
    ["hookspecs", "distributed", "comm_hooks"],
    ["imports", "comm", "hooks"],  # hooks: the old import path of comm_hooks
    ["plugin"],
    ["config", "legacy_hooks"],
    ["core"],
    ["trainer", "launch"],
    ["worker", "doctor"],
    ["smoke", "bench"],
    ["commands"],
    ["cli"],
    ["__main__"],
]
LAYER = {name: index for index, names in enumerate(LAYERS) for name in names}
PACKAGE_IMPORTS = {"errors", "version", "markers"}  # what ``ddpx/__init__.py`` may import eagerly


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree) -> set:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, imported ddpx module)`` for every import in the file, local ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "ddpx"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ddpx":
                continue
            if node.module is None or module == "ddpx":  # from . import x: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def _part(module: str) -> str:
    """``ddpx.comm_hooks.int8`` -> ``hooks``; ``ddpx`` -> ``""`` (the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports() -> list[str]:
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        part = _part(name)
        rel = path.relative_to(ROOT.parent)
        if part and part not in LAYER:
            problems.append(f"{rel}: module '{part}' has no layer in tests/test_layers.py")
            continue
        for line, imported in imports_of(path):
            target = _part(imported)
            if not part:  # the package facade
                if target not in PACKAGE_IMPORTS:
                    problems.append(f"{rel}:{line}: ddpx/__init__.py imports {imported} eagerly")
                continue
            if target == part or target == "":
                continue
            if target not in LAYER:
                problems.append(f"{rel}:{line}: imports {imported}, which has no layer")
            elif LAYER[target] >= LAYER[part]:
                problems.append(f"{rel}:{line}: {name} (layer {LAYER[part]}) imports {imported} "
                                f"(layer {LAYER[target]}): an upward import")
    return problems


def test_no_module_imports_upward():
    assert upward_imports() == []


def test_the_core_chain_is_in_the_documented_order():
    chain = ["errors", "markers", "hookspecs", "imports", "plugin", "config", "core", "trainer"]
    assert [LAYER[m] for m in chain] == sorted(LAYER[m] for m in chain)
    assert len({LAYER[m] for m in chain}) == len(chain)


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    fake = tmp_path / "ddpx"
    fake.mkdir()
    (fake / "__init__.py").write_text("from .errors import DdpxError\n")
    (fake / "errors.py").write_text("class DdpxError(Exception):\n    pass\n")
    (fake / "config.py").write_text("def load():\n    from .trainer import Trainer\n")
    (fake / "trainer.py").write_text("from .config import load\n")
    monkeypatch.setitem(globals(), "ROOT", fake)
    assert upward_imports() == ["ddpx/config.py:2: ddpx.config (layer 5) imports ddpx.trainer (layer 7): an upward import"]
