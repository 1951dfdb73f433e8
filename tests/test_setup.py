"""Set-up: scripts/setup.sh's arguments and the environment it runs `ddpx train` in, and the
extension compiled once (scripts/extension_build.py's record of what ddpx/_C*.so was built
from, setup.py's reuse of it, the progress lines setup.sh shows)."""

import importlib.util
import os
import re
import shutil
import sys
import time

import pytest

import harness

ROOT = harness.ROOT


def _extension_build():
    spec = importlib.util.spec_from_file_location("extension_build", ROOT / "scripts" / "extension_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


eb = _extension_build()


@pytest.fixture
def checkout(tmp_path):
    """A checkout's build inputs: setup.py, csrc/, and a built extension."""
    (tmp_path / "setup.py").write_text("setup()\n")
    (tmp_path / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "extension_build.py", tmp_path / "scripts")
    (tmp_path / "csrc" / "ops").mkdir(parents=True)
    (tmp_path / "csrc" / "module.cpp").write_text("int x;\n")
    (tmp_path / "csrc" / "ops" / "int8.h").write_text("#pragma once\n")
    (tmp_path / "ddpx").mkdir()
    so = tmp_path / "ddpx" / "_C.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"\x7fELF built")
    return tmp_path, str(so)


def test_a_recorded_build_is_current_until_an_input_changes(checkout, monkeypatch):
    root, so = checkout
    record = eb.build_record(str(root), "2.13.0+cpu", cuda=False, environ={})
    assert eb.stale_because(so, record) == "no record of what it was built from"
    eb.write_stamp(so, record)
    assert eb.stale_because(so, record) is None
    # each input, changed alone
    (root / "csrc" / "ops" / "int8.h").write_text("#pragma once\n// edited\n")
    assert eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", False, {})) == \
        "csrc/ or setup.py changed since the build"
    (root / "csrc" / "ops" / "int8.h").write_text("#pragma once\n")
    assert eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", False, {})) is None
    (root / "csrc" / "ops" / "new_kernel.cpp").write_text("")
    assert "csrc/ or setup.py changed" in eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", False, {}))
    os.remove(root / "csrc" / "ops" / "new_kernel.cpp")
    (root / "setup.py").write_text("setup(ext_modules=[])\n")
    assert "csrc/ or setup.py changed" in eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", False, {}))
    (root / "setup.py").write_text("setup()\n")
    assert eb.stale_because(so, eb.build_record(str(root), "2.4.1+cpu", False, {})) == \
        "built against torch 2.13.0+cpu, torch 2.4.1+cpu is installed"
    assert eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", True, {})) == \
        "built without CUDA kernels, now with"
    assert eb.stale_because(so, eb.build_record(str(root), "2.13.0+cpu", False, {"CXX": "clang++"})) == \
        "CXX changed since the build"
    # the file itself replaced (another build, a copy from elsewhere) or gone
    with open(so, "ab") as f:
        f.write(b"more")
    assert eb.stale_because(so, record) == "_C.cpython-311-x86_64-linux-gnu.so changed since it was recorded"
    os.remove(so)
    assert eb.stale_because(so, record) == "not built yet"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pip_progress = _script("pip_progress")


def test_progress_shows_pip_its_build_lines_and_one_line_per_compiled_file():
    pip_verbose = [
        "Using pip 24.0 from /v/lib/python3.11/site-packages/pip (python 3.11)",
        "Collecting pytest (from ddpx==0.1.0)",
        "  Found link https://files/pytest-8.tar.gz, version: 8",
        "  Downloading pytest-8.0-py3-none-any.whl (334 kB)",
        "  running build_ext",
        "  ddpx._C: compiling 14 files (not built yet; MAX_JOBS=2)",
        "  Emitting ninja build file /tmp/b/build.ninja...",
        "  ddpx._C: compiling csrc/comm_hooks/allreduce.cpp, csrc/comm_hooks/bindings.cpp (0 of 14 done, 8 s)",
        # as torch's BuildExtension writes them (ninja -v, a step once it is done), "-c -c" included
        "  [1/14] c++ -MMD -MF /tmp/b/module.o.d -fPIC -I/src/ddpx/csrc -I/v/include/python3.11 -c -c "
        "/src/ddpx/csrc/module.cpp -o /tmp/b/module.o -O3 -std=c++17 -DTORCH_EXTENSION_NAME=_C",
        "  In file included from /src/ddpx/csrc/module.cpp:1:",
        "  [14/14] /usr/local/cuda/bin/nvcc -I/src/ddpx/csrc -c /src/ddpx/csrc/ops/cuda/int8_kernel.cu -o /tmp/b/k.o",
        "  ddpx._C: built in 5 min 1 s",
        "Installing collected packages: pytest, ddpx",
        "Successfully installed ddpx-0.1.0 pytest-8.0",
    ]
    progress = pip_progress.Progress("/src/ddpx")
    shown = [line for line in map(progress.feed, pip_verbose) if line]
    assert shown == [
        "Collecting pytest (from ddpx==0.1.0)",
        "  Downloading pytest-8.0-py3-none-any.whl (334 kB)",
        "ddpx._C: compiling 14 files (not built yet; MAX_JOBS=2)",
        "ddpx._C: compiling csrc/comm_hooks/allreduce.cpp, csrc/comm_hooks/bindings.cpp (0 of 14 done, 8 s)",
        "ddpx._C: [1/14] compiled csrc/module.cpp",
        "ddpx._C: [14/14] compiled csrc/ops/cuda/int8_kernel.cu",
        "ddpx._C: built in 5 min 1 s",
        "Installing collected packages: pytest, ddpx",
        "Successfully installed ddpx-0.1.0 pytest-8.0",
    ]


def test_progress_says_what_pip_is_still_doing_after_9_quiet_seconds():
    now = [0.0]
    progress = pip_progress.Progress("/src/ddpx", clock=lambda: now[0])
    assert progress.quiet_for() == 9
    assert progress.feed("  Found link https://files/six-1.tar.gz, version: 1") is None  # not said without -v
    now[0] = 9.0
    assert progress.quiet_for() == 0 and progress.heartbeat() == "setup.sh: still starting pip (9 s)"
    assert progress.quiet_for() == 9  # the heartbeat spoke
    progress.feed("  Downloading https://files/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (899.7 MB)")
    now[0] = 84.0
    assert progress.heartbeat() == \
        "setup.sh: still downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (899.7 MB) (1 min 15 s)"
    progress.feed("Installing collected packages: mlflow, wandb, tensorboard")
    now[0] = 225.0
    assert progress.heartbeat() == "setup.sh: still installing 3 packages (2 min 21 s)"
    progress.feed("  running build_ext")  # a line it does not show: the silence goes on
    now[0] = 234.0
    assert progress.quiet_for() == 0 and progress.heartbeat() == "setup.sh: still building ddpx._C (9 s)"


def test_the_progress_filter_speaks_while_its_input_is_silent(monkeypatch, capsys):
    """pip_progress.py's loop: each line as it comes, and a heartbeat whenever the input is
    quiet for HEARTBEAT_S (here 0.2 s)."""
    import io
    import threading

    monkeypatch.setattr(pip_progress, "HEARTBEAT_S", 0.2)
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.FileIO(read_end)))
    filtered = threading.Thread(target=pip_progress.main)
    filtered.start()
    with open(write_end, "w") as pip:
        pip.write("Installing collected packages: six\n")
        pip.flush()
        time.sleep(0.5)
        pip.write("Successfully installed six-1.17.0\n")
    filtered.join(timeout=10)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Installing collected packages: six" and lines[-1] == "Successfully installed six-1.17.0"
    assert lines[1:-1] and all(line == "setup.sh: still installing 1 package (0 s)" for line in lines[1:-1]), lines


def test_the_compile_heartbeat_names_the_files_a_compiler_has_open(tmp_path):
    """setup.py's line every 8 s while it compiles: the sources of this checkout in the
    compilers' command lines (another checkout's are not ours) and the objects written since."""
    root, objects, proc = tmp_path / "src", tmp_path / "build", tmp_path / "proc"
    for pid, args in ((11, ["cc1plus", "-quiet", "-c", f"{root}/csrc/comm_hooks/bindings.cpp"]),
                      (12, ["c++", "-MMD", "-c", "-c", f"{root}/csrc/comm_hooks/allreduce.cpp", "-o", "x.o"]),
                      (13, ["c++", "-c", "/elsewhere/csrc/comm_hooks/int8.cpp"]),
                      (14, ["python", f"{root}/csrc/module.cpp"])):  # no -c: not a compile
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes("\0".join(args).encode() + b"\0")
    assert eb.compiling_now(str(root), proc=str(proc)) == ["csrc/comm_hooks/allreduce.cpp",
                                                           "csrc/comm_hooks/bindings.cpp"]
    heartbeat = eb.CompileHeartbeat(str(root), str(objects), total=19, proc=str(proc))
    heartbeat.start = time.time() - 125
    (objects / "csrc" / "ops").mkdir(parents=True)
    (objects / "csrc" / "ops" / "cast.o").write_bytes(b"")  # written since the start
    (objects / "csrc" / "ops" / "int8.o").write_bytes(b"")
    os.utime(objects / "csrc" / "ops" / "int8.o", (heartbeat.start - 60, heartbeat.start - 60))  # an earlier build's
    assert heartbeat.line() == ("ddpx._C: compiling csrc/comm_hooks/allreduce.cpp, csrc/comm_hooks/bindings.cpp "
                                "(1 of 19 done, 2 min 5 s)")
    linking = eb.CompileHeartbeat(str(root), str(objects), total=1, proc=str(tmp_path / "none"))
    linking.start = heartbeat.start  # every file compiled, no compiler running: the link
    assert linking.line() == "ddpx._C: linking (1 of 1 done, 2 min 5 s)"


def _copy_checkout(dest):
    for name in ("setup.py", "README.md", "pyproject.toml"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    for folder in ("csrc", "scripts"):
        shutil.copytree(ROOT / folder, dest / folder)
    (dest / "ddpx").mkdir()
    shutil.copy2(ROOT / "ddpx" / "version.py", dest / "ddpx" / "version.py")
    (dest / "ddpx" / "__init__.py").write_text("")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_setup_py_reuses_a_current_extension_and_compiles_a_stale_one(tmp_path):
    """`python setup.py build_ext --inplace` (what pip's editable install runs): with the
    record matching, it copies nothing new and compiles nothing; after a source edit it
    starts compiling (stopped at its first line)."""
    import glob

    import torch

    built = glob.glob(str(ROOT / "ddpx" / "_C.*.so"))
    if not built:
        pytest.skip("the extension is not built in this checkout")
    _copy_checkout(tmp_path)
    so = tmp_path / "ddpx" / os.path.basename(built[0])
    shutil.copy2(built[0], so)
    record = eb.build_record(str(tmp_path), torch.__version__, cuda=False)
    if torch.version.cuda and os.environ.get("DDPX_CUDA", "auto") not in ("0", "false", "no", "off"):
        pytest.skip("a CUDA torch: the CPU-only record here would not match setup.py's")
    eb.write_stamp(str(so), record)
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    (reused,) = harness.run_commands([cmd], tmp_path, timeout=120, cwd=tmp_path, names=["reuse"])
    assert reused.returncode == 0, reused.output[-3000:]
    assert f"ddpx._C: ddpx/{so.name} is up to date (these sources, torch {torch.__version__}): not compiling again" \
        in reused.output
    assert "ninja" not in reused.output.lower()
    assert eb.stale_because(str(so), record) is None  # still recorded, after setuptools' copy back

    with open(tmp_path / "csrc" / "module.cpp", "a") as f:
        f.write("\n// edited\n")
    # stopped at its first heartbeat, 8 s into the compile (or after 40 s: far too little to
    # compile 19 files)
    log = tmp_path / "stale.log"
    proc = harness.start(cmd, log, harness.base_env(), cwd=tmp_path)
    heartbeat = re.compile(r"^ddpx\._C: compiling (csrc/\S+\.cpp(?:, csrc/\S+\.cpp)*) \((\d+) of (\d+) done, \d+ s\)$",
                           re.M)
    harness.wait_for(lambda: proc.poll() is not None or heartbeat.search(log.read_text()), 40, poll=0.1)
    (edited,) = harness.finish([proc], [log], timeout=0)
    compiling = re.search(r"ddpx\._C: compiling (\d+) files \(csrc/ or setup.py changed since the build;", edited.output)
    beat = heartbeat.search(edited.output)
    assert compiling and beat, edited.output[-3000:]
    # the files in the compilers' command lines, this copy's CPU sources
    sources = {os.path.relpath(path, tmp_path) for path in glob.glob(str(tmp_path / "csrc" / "**" / "*.cpp"),
                                                                     recursive=True) if "/cuda/" not in path}
    assert beat[3] == compiling[1] == str(len(sources)) and int(beat[2]) < len(sources), beat[0]
    assert set(beat[1].split(", ")) <= sources, beat[0]


@pytest.mark.slow
def test_setup_sh_refuses_an_unknown_argument(tmp_path):
    (ended,) = harness.run_commands([["bash", str(ROOT / "scripts" / "setup.sh"), "tests"]], tmp_path, timeout=30)
    assert ended.returncode == 2
    assert ended.output.strip() == ("setup.sh: unknown argument 'tests': use no argument, 'test', or "
                                    "'train [ddpx train arguments]'")


def _stand_in_pythons(tmp_path):
    """An externally managed "system" python3 and the venv python it creates, stand-ins that
    log what they are asked (and succeed)."""
    log = tmp_path / "log"
    inner = f"#!/bin/bash\necho \"venv $*\" >> {log}\nexit 0\n"
    system = tmp_path / "python3"
    system.write_text(f"""#!/bin/bash
echo "system $*" >> {log}
case "$1" in
  -c) exit 0 ;;
  -m) if [ "$2" = venv ]; then mkdir -p "$3/bin"; printf '%s' '{inner}' > "$3/bin/python"
        chmod +x "$3/bin/python"; exit 0; fi
      echo "pip on the system python" >> {log}; exit 1 ;;
esac
""")
    system.chmod(0o755)
    return system, log


@pytest.mark.slow
def test_setup_sh_train_runs_ddpx_train_in_the_venv_it_made(tmp_path):
    """The README's first command, `bash scripts/setup.sh train`, on an externally managed
    python: set-up goes into the venv, and so does `ddpx train` (not the system's PATH)."""
    system, log = _stand_in_pythons(tmp_path)
    venv = tmp_path / "venv"
    (ended,) = harness.run_commands([["bash", str(ROOT / "scripts" / "setup.sh"), "train", "trainer.epochs=1"]],
                                    tmp_path, timeout=60, env={"PYTHON": str(system), "DDPX_VENV": str(venv)},
                                    cwd=tmp_path)
    assert ended.returncode == 0, ended.output
    calls = log.read_text().splitlines()
    assert "pip on the system python" not in calls
    assert "venv -m pip install -v --no-build-isolation -e ." in calls  # runtime only: no [test]
    assert calls[-1] == "venv -m ddpx train trainer.epochs=1"
    assert f"setup.sh: ddpx train trainer.epochs=1 (with {venv}/bin/python)" in ended.output


@pytest.mark.slow
def test_setup_sh_makes_a_venv_on_an_externally_managed_python(tmp_path):
    """scripts/setup.sh with a stand-in interpreter that is externally managed: it must create
    the venv and install there (the stand-ins log what they are asked)."""
    venv = tmp_path / "venv"
    system, log = _stand_in_pythons(tmp_path)
    code, out, err = harness.run(["bash", str(ROOT / "scripts" / "setup.sh"), "test"], timeout=60,
                                 env={"PYTHON": str(system), "DDPX_VENV": str(venv)})
    assert code == 0, err
    calls = log.read_text()
    assert "pip on the system python" not in calls and "system -m venv" in calls
    assert "venv -m pip install -v --no-build-isolation -e .[test]" in calls
    assert f". {venv}/bin/activate" in out


def _python_with_torch(tmp_path, real):
    """A stand-in python that is not externally managed and has torch: it logs what pip is
    asked, and ``real`` says where it installs."""
    log, python = tmp_path / "log", tmp_path / "python3"
    python.write_text(f"""#!/bin/bash
case "$1" in
  -c) case "$2" in
        *EXTERNALLY-MANAGED*) exit 1 ;;
        *purelib*) exec {real} -c "$2" ;;
        *) exit 0 ;;
      esac ;;
  -m) echo "$*" >> {log}; exit 0 ;;
  *) cat > /dev/null; exit 0 ;;
esac
""")
    python.chmod(0o755)
    return python, log


@pytest.mark.slow
def test_setup_sh_says_where_it_installs_before_it_installs(tmp_path):
    """Into a virtual environment, or into a global interpreter's site-packages (a pyenv or
    conda python): said, with the folder, before the first pip install."""
    import sysconfig

    base = getattr(sys, "_base_executable", sys.executable)
    interpreters = [(sys.executable, f"setup.sh: installing into the virtual environment {sys.prefix} "
                                     f"({sysconfig.get_paths()['purelib']})")] if sys.prefix != sys.base_prefix else []
    if base != sys.executable or sys.prefix == sys.base_prefix:  # this python's own interpreter, without the venv
        interpreters.append((base, f"setup.sh: installing into {base}, not a virtual environment: its packages in "))
    for real, said in interpreters:
        python, log = _python_with_torch(tmp_path, real)
        code, out, err = harness.run(["bash", str(ROOT / "scripts" / "setup.sh")], timeout=60,
                                     env={"PYTHON": str(python)})
        assert code == 0, err
        lines = out.splitlines()
        where = next(i for i, line in enumerate(lines) if line.startswith("setup.sh: installing into "))
        assert lines[where].startswith(said), lines[where]
        assert where < lines.index("setup.sh: checking for an installed torch")
        assert log.read_text().splitlines() == ["-m pip install -v setuptools wheel ninja pybind11",
                                                "-m pip install -v --no-build-isolation -e .",
                                                "-m compileall -q ddpx plugins"]
        log.unlink()
    assert "get torch and ddpx (to keep them apart, activate a venv or set PYTHON=/path/to/venv/bin/python " \
           "first)" in lines[where]


@pytest.mark.slow
def test_setup_sh_says_which_torch_wheel_it_installs(tmp_path):
    """The README said set-up installs "the CPU wheel this project's CI uses"; from PyPI alone
    `pip install torch==2.13.0` is the multi-GB CUDA build. setup.sh must say so when it installs torch."""
    log = tmp_path / "log"
    python = tmp_path / "python3"  # not externally managed, no torch; logs what pip is asked
    python.write_text(f"""#!/bin/bash
case "$1" in
  -c) exit 1 ;;
  -m) echo "$*" >> {log}; exit 0 ;;
  *) cat > /dev/null; exit 0 ;;
esac
""")
    python.chmod(0o755)
    code, out, err = harness.run(["bash", str(ROOT / "scripts" / "setup.sh")], timeout=60,
                                 env={"PYTHON": str(python)})
    assert code == 0, err
    assert "-m pip install -v torch==2.13.0" in log.read_text()
    assert ("setup.sh: installing torch==2.13.0 (a CPU wheel where pip sees one; from PyPI alone, on Linux, "
            "the CUDA build: several GB)") in out
