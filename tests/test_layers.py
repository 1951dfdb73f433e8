"""The layers of ``ddpx/``: every module imports only from the layers below its own.

Bottom to top: the leaves (errors, import paths, sockets, kernels, models); the plugin
machinery; the config; the per-rank plumbing that does not know the trainer (``rank/``);
the public comm hooks and data; fused_allreduce and the optimizers built on the hooks; the
strategies (``strategies/``: what each parallelism means for the run, asked by the trainer);
the trainer (``train/``); live recovery on torchft (``recovery/``: below the launcher, which checks
torchft and whose ``ddpx lighthouse`` serves it); the launcher (``launch/``,
what runs before and around torchrun); and the programs built from them (the worker, the
doctor, the smoke run, the benchmarks, the CLI). The README's layout section lists them.

Every import counts: one inside a function (those exist to keep ``ddpx --version`` from
importing torch, never to dodge a cycle) and one under ``if TYPE_CHECKING:`` too. An
annotation-only import that must point upward is listed in ``ANNOTATION_ONLY`` with the
reason. A new module must be given a layer here: the test fails for a module it does not know.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ddpx"

# Bottom first. A module may import from strictly lower layers only; the modules of one
# package (ddpx.train.trainer -> ddpx.train.losses) may import each other.
LAYERS = [
    ["errors", "version", "collector", "_C"],
    ["imports", "net", "ops", "models", "console"],
    ["plugin"],
    ["config"],
    ["rank"],
    ["comm_hooks", "data"],
    ["fused_allreduce", "optim", "recovery"],
    ["strategies"],
    ["train"],
    ["launch"],
    ["worker", "doctor"],
    ["smoke", "bench"],
    ["cli"],
    ["__main__"],
]
LAYER = {name: index for index, names in enumerate(LAYERS) for name in names}
PACKAGE_IMPORTS = {"errors", "version", "plugin"}  # what ``ddpx/__init__.py`` may import eagerly

# (module, imported module): why an upward import stays. Only ``if TYPE_CHECKING:`` imports.
ANNOTATION_ONLY = {
    ("ddpx.plugin.hookspecs", "ddpx.config"):
        "the hook signatures name the Config every hook receives; annotations only, nothing is imported at run time",
    ("ddpx.plugin.hookspecs", "ddpx.train.trainer"):
        "the hook signatures name the Trainer every hook receives; annotations only, nothing is imported at run time",
    ("ddpx.strategies.base", "ddpx.train.trainer"):
        "the strategy's methods name the Trainer that asks them; annotations only, nothing is imported at run time",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                found.update(id(n) for n in ast.walk(child))
    return found


def imports_of(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, imported ddpx module, under TYPE_CHECKING)`` for every import in the file,
    local ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    annotation_only = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        typing_only = id(node) in annotation_only
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, typing_only) for alias in node.names
                      if alias.name.split(".")[0] == "ddpx"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ddpx":
                continue
            if node.module is None or module == "ddpx":  # from . import x: x may be a module
                found += [(node.lineno, f"{module}.{alias.name}", typing_only) for alias in node.names]
            else:
                found.append((node.lineno, module, typing_only))
    return found


def _part(module: str) -> str:
    """``ddpx.comm_hooks.int8`` -> ``comm_hooks``; ``ddpx`` -> ``""`` (the package itself)."""
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
        for line, imported, typing_only in imports_of(path):
            target = _part(imported)
            if not part:  # the package facade
                if target not in PACKAGE_IMPORTS:
                    problems.append(f"{rel}:{line}: ddpx/__init__.py imports {imported} eagerly")
                continue
            if target == part or target == "":
                continue
            if target not in LAYER:
                problems.append(f"{rel}:{line}: imports {imported}, which has no layer")
            elif LAYER[target] >= LAYER[part] and not (typing_only and (name, imported) in ANNOTATION_ONLY):
                problems.append(f"{rel}:{line}: {name} (layer {LAYER[part]}) imports {imported} "
                                f"(layer {LAYER[target]}): an upward import")
    return problems


def test_no_module_imports_upward():
    assert upward_imports() == []


def test_the_trainer_sits_on_the_plugin_machinery_the_config_and_the_rank_plumbing():
    chain = ["errors", "imports", "plugin", "config", "rank", "strategies", "train", "launch", "worker", "cli"]
    assert [LAYER[m] for m in chain] == sorted(LAYER[m] for m in chain)
    assert len({LAYER[m] for m in chain}) == len(chain)


def test_every_annotation_only_exception_is_still_needed():
    imported = {(_module_name(path), module) for path in ROOT.rglob("*.py")
                for _, module, typing_only in imports_of(path) if typing_only}
    assert set(ANNOTATION_ONLY) <= imported


def test_an_upward_import_is_caught_also_under_type_checking(tmp_path, monkeypatch):
    fake = tmp_path / "ddpx"
    (fake / "config").mkdir(parents=True)
    (fake / "train").mkdir()
    (fake / "__init__.py").write_text("from .errors import DdpxError\n")
    (fake / "errors.py").write_text("class DdpxError(Exception):\n    pass\n")
    (fake / "config" / "loader.py").write_text("def load():\n    from ..train.trainer import Trainer\n")
    (fake / "train" / "trainer.py").write_text("from ..config.loader import load\n")
    (fake / "train" / "losses.py").write_text("from .trainer import load\n")  # inside one package: fine
    (fake / "rank.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .train.trainer import Trainer\n")
    monkeypatch.setitem(globals(), "ROOT", fake)
    assert upward_imports() == [
        "ddpx/config/loader.py:2: ddpx.config.loader (layer 3) imports ddpx.train.trainer (layer 8): an upward import",
        "ddpx/rank.py:3: ddpx.rank (layer 4) imports ddpx.train.trainer (layer 8): an upward import",
    ]


# --- sizes: a module a reader can hold, a step path of functions that fit a screen ------------

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# What runs in a training step or around it: the trainer, the strategies, the comm hooks and
# kernels' wrappers, the data and the per-rank plumbing, the built-in plugins.
TRAINING_PATH = ["ddpx/train", "ddpx/strategies", "ddpx/comm_hooks", "ddpx/data", "ddpx/rank", "ddpx/optim.py",
                 "ddpx/ops.py", "ddpx/fused_allreduce.py", "plugins/ddpx_plugins"]


def _python_files(*roots):
    for root in roots:
        path = ROOT.parent / root
        yield from ([path] if path.suffix == ".py" else sorted(path.rglob("*.py")))


def long_modules() -> list:
    return [f"{p.relative_to(ROOT.parent)}: {n} lines" for p in _python_files("ddpx", "plugins")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]


def long_functions() -> list:
    found = []
    for path in _python_files(*TRAINING_PATH):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_module_is_over_600_lines():
    assert long_modules() == []


def test_no_function_on_the_training_path_is_over_60_lines():
    assert long_functions() == []


def test_the_training_path_exists_as_listed():
    assert all((ROOT.parent / root).exists() for root in TRAINING_PATH)
