"""Every config key (ddpx's own and every built-in plugin's section) and every hookspec
is documented in docs/, the README's links to docs/ pages resolve, and the suite's counts and
times live in docs/testing.md."""

import importlib.util
import inspect
import os
import pathlib
import re

import pytest

from ddpx.plugin import hookspecs
from ddpx.config.loader import plugin_defaults
from ddpx.config.schema import DEFAULTS, FREE_FORM
from ddpx.plugin.manager import make_plugin_manager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def docs_text():
    return "\n".join(open(os.path.join(DOCS, name)).read() for name in sorted(os.listdir(DOCS)) if name.endswith(".md"))


def dotted_keys(section, prefix=""):
    for key, value in section.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in FREE_FORM:
            yield from dotted_keys(value, f"{path}.")
        else:
            yield path


def test_every_config_key_is_documented():
    defaults = {**DEFAULTS, **plugin_defaults(make_plugin_manager(None))}
    keys = list(dotted_keys(defaults))
    assert "trainer.compile" in keys and "logging.tensorboard" in keys and "checkpoint.keep" in keys
    text = docs_text()
    missing = [key for key in keys if f"`{key}`" not in text]
    assert not missing, f"config keys not documented in docs/: {missing}"


def test_every_hookspec_is_documented():
    specs = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("ddpx_")]
    assert len(specs) > 15
    text = docs_text()
    missing = [name for name in specs if f"`{name}(" not in text]
    assert not missing, f"hooks not documented in docs/: {missing}"


def test_readme_links_to_docs_resolve():
    readme = open(os.path.join(ROOT, "README.md")).read()
    links = re.findall(r"\]\((docs/[^)#]+|examples/[^)#]+)", readme)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing


def test_the_readme_layout_names_every_module():
    readme = open(os.path.join(ROOT, "README.md")).read()
    layout = readme[readme.index("## Layout"):readme.index("## Development")]
    missing = []
    for package in ("ddpx", os.path.join("plugins", "ddpx_plugins")):
        for path in sorted(pathlib.Path(ROOT, package).rglob("*.py")):
            if path.name == "__init__.py" and path.parent.name not in layout:
                missing.append(str(path.relative_to(ROOT)))
            elif path.name != "__init__.py" and path.name not in layout:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"README.md's layout section does not name: {missing}"


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set:
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)  # no headings in code blocks
    return {github_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_links_between_docs_resolve_with_their_anchors():
    pages = [os.path.join(ROOT, "README.md")] + [os.path.join(DOCS, n) for n in sorted(os.listdir(DOCS)) if n.endswith(".md")]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", open(page).read(), flags=re.S | re.M)
        for target, anchor in re.findall(r"\]\(([^)#\s:]*\.md|)#([^)\s]+)\)", text):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            if not os.path.exists(path) or anchor not in anchors(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}#{anchor}")
    assert not broken, broken


def _hooks_md_maker():
    spec = importlib.util.spec_from_file_location("make_plugin_hooks_md", os.path.join(DOCS, "make_plugin_hooks_md.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_reference_is_generated_from_hookspecs():
    """docs/plugin_hooks.md is made from ddpx/plugin/hookspecs.py; regenerate it with
    ``python docs/make_plugin_hooks_md.py``."""
    with open(os.path.join(DOCS, "plugin_hooks.md")) as f:
        committed = f.read()
    assert committed == _hooks_md_maker().reference_markdown(), "docs/plugin_hooks.md is stale: python docs/make_plugin_hooks_md.py"


def test_the_reference_states_when_batch_end_runs():
    text = _hooks_md_maker().reference_markdown()
    assert "-> ddpx_batch_end for each micro-batch" in text
    assert "runs after every micro-batch" in inspect.getdoc(hookspecs.ddpx_batch_end).lower().replace("\n", " ")


def test_the_trainer_attribute_list_is_complete_and_exists():
    """hookspecs.TRAINER_ATTRIBUTES is the one list: every public attribute a Trainer
    has is in it, every listed name exists, and the Trainer's docstring is made from it."""
    from ddpx.config import load_config
    from ddpx.train.trainer import Trainer

    trainer = Trainer(load_config(None, ["logging.progress=false"]))
    public = {name for name in vars(trainer) if not name.startswith("_")}
    public |= {name for name, value in vars(Trainer).items() if isinstance(value, property)}
    assert public <= set(hookspecs.TRAINER_ATTRIBUTES), public - set(hookspecs.TRAINER_ATTRIBUTES)
    assert all(hasattr(trainer, name) for name in hookspecs.TRAINER_ATTRIBUTES)
    assert all(hasattr(trainer, name.partition("(")[0]) for name in hookspecs.TRAINER_METHODS)
    assert all(hasattr(trainer, name.partition("(")[0]) for name in hookspecs.TRAINER_LIFECYCLE)
    assert "``shared``" in Trainer.__doc__


def _section(text: str, heading: str) -> str:
    """From ``heading`` (a whole line) to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = text.find(f"\n{level} ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_every_builtin_plugin_has_its_section_in_plugins_md():
    from ddpx.plugin.builtin import BUILTIN_PLUGINS

    text = open(os.path.join(DOCS, "plugins.md")).read()
    builtin = _section(text, "## Built-in plugins")
    table = [m for m in re.findall(r"^\| \[`(\w+)`\]", builtin, flags=re.M)]
    assert table == list(BUILTIN_PLUGINS), "docs/plugins.md's table of built-in plugins vs ddpx/plugin/builtin.py"
    headings = " ".join(re.findall(r"^### (.+)$", builtin, flags=re.M))
    assert [name for name in BUILTIN_PLUGINS if not re.search(rf"\b{name}\b", headings)] == []
    count = {10: "ten"}.get(len(BUILTIN_PLUGINS), str(len(BUILTIN_PLUGINS)))
    for page, said in (("README.md", "the built-in ones\n(`" + "`, `".join(BUILTIN_PLUGINS)),
                       (os.path.join("docs", "plugins.md"), f"The {count} built-in ones")):
        assert " ".join(said.split()) in " ".join(open(os.path.join(ROOT, page)).read().split()), page


def _code_block(text: str, first_line: str) -> str:
    """The fenced block whose first line is ``first_line``."""
    match = re.search(r"^```\w*\n(" + re.escape(first_line) + r"\n.*?)^```", text, flags=re.S | re.M)
    assert match, f"no code block starting with {first_line!r}"
    return match.group(1)


def test_the_plugin_example_greets_from_every_rank_as_shown(ranks, tmp_path):
    """docs/plugins.md's ddpx_hello.py, run as its console block shows, prints what the block says."""
    text = open(os.path.join(DOCS, "plugins.md")).read()
    (tmp_path / "ddpx_hello.py").write_text(_code_block(text, "# ddpx_hello.py"))
    console = _code_block(text, "$ ddpx train plugins.enable=[ddpx_hello] logging.all_ranks=true trainer.epochs=1")
    command, *shown = console.splitlines()
    expected = [line for line in shown if line.startswith("[rank")]
    assert "[rank1] hi from rank 1 of 2" in expected
    rc, out, err = ranks.cli([*command.split()[2:], "logging.progress=false", "checkpoint.enabled=false"],
                             timeout=120, cwd=tmp_path)
    assert rc == 0, out + err
    printed = (out + err).splitlines()
    # each rank's lines in the block's order; the ranks' lines interleave as they come
    for rank in ("[rank0]", "[rank1]"):
        mine = [line for line in expected if line.startswith(rank)]
        assert [line for line in printed if line in mine] == mine, out + err


def test_the_ray_recipe_in_engines_md_is_what_the_benchmark_runs():
    source = open(os.path.join(ROOT, "benchmarks", "bench_engines.py")).read()
    recipe = source.split("(tests/test_docs.py: the page shows this text) ---\n")[1].split("# --- end of the recipe")[0]
    assert "ddpx.fit(" in recipe and recipe.strip() in open(os.path.join(DOCS, "engines.md")).read()


TESTING_MD = os.path.join(DOCS, "testing.md")
LANES = ("fast lane", "whole suite", "fresh clone")


def suite_counts() -> dict:
    """docs/testing.md's counts table: lane -> (passed, skipped, seconds)."""
    table = _section(open(TESTING_MD).read(), "## Counts and times")
    row = r"^\| ([a-z ]+) \| (\d+) \| (\d+) \| (?:(\d+) min )?(\d+) s \| \d{4}-\d\d-\d\d, [0-9a-f]{7,40}, .+\|$"
    rows = re.findall(row, table, flags=re.M)
    return {lane: (int(passed), int(skipped), 60 * int(minutes or 0) + int(seconds))
            for lane, passed, skipped, minutes, seconds in rows}


def test_the_suites_counts_and_times_are_in_testing_md_not_in_the_readme():
    """The figures that change with every session live in docs/testing.md, one parseable row
    per lane (passed, skipped, time, date, commit); the README links the page and states none."""
    counts = suite_counts()
    assert sorted(counts) == sorted(LANES), f"docs/testing.md's counts table: a row per lane {LANES}, got {counts}"
    lanes = re.findall(r"^\| ([a-z ]+) \| `", _section(open(TESTING_MD).read(), "## Lanes"), flags=re.M)
    assert lanes == list(LANES), "the lanes table and the counts table name the same lanes"
    fast, whole, fresh = (counts[lane] for lane in LANES)
    assert whole[0] > fast[0] and whole[0] + whole[1] > fast[0] + fast[1]  # the fast lane is part of the suite
    assert whole[2] > fast[2] and fresh[2] > fast[2]

    readme = open(os.path.join(ROOT, "README.md")).read()
    development = _section(readme, "## Development")
    assert "[docs/testing.md](docs/testing.md)" in development
    assert "| [docs/testing.md](docs/testing.md) |" in _section(readme, "## Where to read on")
    flat = " ".join(readme.split())
    stale = [m.group(0) for pattern in (r"\b\d+ passed\b", r"\b\d+ (?:CUDA tests )?skipped\b", r"\b\d+ min \d+ s\b",
                                         r"\b\d+(?:\.\d+)? ?s on \d+ (?:idle )?cores\b")
             for m in re.finditer(pattern, flat)]
    assert not stale, f"README.md states the suite's counts or times (they belong in docs/testing.md): {stale}"


@pytest.mark.slow  # a pytest --collect-only of the suite, about 20 s
def test_the_test_counts_in_testing_md_match_the_suite(tmp_path):
    """docs/testing.md's counts (passed + skipped) of the fast lane and of the whole suite are
    within 5% of what pytest collects, so they cannot go stale by a release's worth of tests
    unnoticed."""
    import sys

    import harness

    counts = suite_counts()
    (collected,) = harness.run_commands([[sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                                          "no:cacheprovider", "-m", "not slow", "tests"]], tmp_path, timeout=300,
                                        cwd=ROOT, names=["collect"])
    found = re.search(r"(\d+)/(\d+) tests collected", collected.output)
    assert found, collected.output[-2000:]
    selected, total = map(int, found.groups())
    for lane, count in (("fast lane", selected), ("whole suite", total), ("fresh clone", total)):
        stated = counts[lane][0] + counts[lane][1]
        assert abs(stated - count) <= 0.05 * count, f"docs/testing.md: {lane}: {stated} tests, pytest collects {count}"


def test_the_bench_comm_note_on_a_step_below_compute_is_quoted_as_printed():
    """``bench comm`` printed measured steps below compute without saying why; the report says it
    now, and docs/cluster.md quotes that line."""
    from ddpx.bench.comm import HookTiming, Measurement, below_compute_note, format_report, recommend

    rounds = [(0.07, s) for s in (0.05871, 0.0601, 0.06161, 0.0632, 0.06541)]
    m = Measurement(2, 16, 1, 450_000, 3.66e8, 0.00123, 0.06161, compute_rounds=rounds)
    m.hooks = [HookTiming("allreduce", 450_000, 0.0628, 0.0742),
               HookTiming("powersgd", 45_000, 0.0617, 0.0502, rounds=[(0.07, 0.05)] * 5)]
    note = below_compute_note(m, ["powersgd"])
    assert note in format_report(m, recommend(m)).splitlines()
    assert f"    {note}\n" in open(os.path.join(DOCS, "cluster.md")).read()


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_build_lines_are_what_the_build_prints():
    """README.md's examples of the set-up's lines: the k-th compiled file is the k-th of the CPU
    build's sources as ninja's build file lists them (sorted: torch writes it so; ninja starts
    them in that order), the file count is theirs, and each line has the form the set-up prints."""
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    csrc = pathlib.Path(ROOT, "csrc")
    sources = sorted(str(p.relative_to(ROOT)) for p in csrc.rglob("*.cpp") if "cuda" not in p.relative_to(csrc).parts)
    step = re.search(r"`ddpx\._C: \[(\d+)/(\d+)\] compiled (\S+)`", readme)
    assert step, "README.md: no example of a compiled file's line"
    k, total, named = int(step[1]), int(step[2]), step[3]
    assert (total, named) == (len(sources), sources[k - 1]), (step[0], sources)
    progress = _script("pip_progress").Progress(ROOT)
    ninja_line = f"[{k}/{total}] c++ -MMD -MF x.o.d -c -c {os.path.join(ROOT, named)} -o x.o -O3"
    assert f"`{progress.feed(ninja_line)}`" == step[0]
    beat = re.search(r"`ddpx\._C: compiling (\S+), (\S+) \(0 of (\d+) done, [\d a-z]+\)`", readme)
    assert beat and [beat[1], beat[2]] == sources[:2] and int(beat[3]) == len(sources), beat and beat[0]
    still = re.search(r"`setup\.sh: still installing (\d+) packages \((\d+) s\)`", readme)
    assert still, "README.md: no example of what set-up says while pip installs"
    now = [0.0]
    progress = _script("pip_progress").Progress(ROOT, clock=lambda: now[0])
    progress.feed("Installing collected packages: " + ", ".join(f"p{i}" for i in range(int(still[1]))))
    now[0] = float(still[2])
    assert f"`{progress.heartbeat()}`" == still[0]
