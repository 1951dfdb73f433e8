"""The C++ extension's build: what ddpx._C was built from, and its progress on a terminal.

setup.py (loaded by path) records, next to the in-place extension (``ddpx/_C.<abi>.so``),
what it was built from: a hash of setup.py, this file and every file under csrc/, the
torch version, whether it has CUDA kernels, and the compiler settings from the
environment, with the file's size and mtime. When all of that still matches, a build
(``pip install -e .``, ``python setup.py build_ext --inplace``) reuses the file instead of
compiling for minutes again: a second ``scripts/setup.sh`` in the same checkout, or one
into another venv with the same torch. Deleting ``ddpx/_C*.so`` forces a fresh build.

    ... | python scripts/extension_build.py progress

reads pip's verbose output and prints what pip says without -v, the lines setup.py
prints about the build and one line per compiled file (ninja's ``[n/N]`` steps): what
scripts/setup.sh shows while it installs.
"""

import hashlib
import json
import os
import re
import sys

# the environment a compile reads beyond the sources and torch: a change means a rebuild
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "TORCH_CUDA_ARCH_LIST", "NVCC_FLAGS")
MESSAGE_PREFIX = "ddpx._C: "  # setup.py's lines about the build; the progress filter passes them on


def sources_digest(root: str) -> str:
    """sha256 over setup.py, this file and every file under csrc/ (names and contents)."""
    paths = [os.path.join(root, "setup.py"), os.path.join(root, "scripts", "extension_build.py")]
    for folder, dirs, files in os.walk(os.path.join(root, "csrc")):
        dirs.sort()
        paths += [os.path.join(folder, name) for name in sorted(files)]
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def build_record(root: str, torch_version: str, cuda: bool, environ=os.environ) -> dict:
    """What a build of the extension from ``root`` now would be made from."""
    return {"sources": sources_digest(root), "torch": torch_version, "cuda": bool(cuda),
            "env": {name: environ.get(name, "") for name in BUILD_ENV}}


def stamp_path(extension_path: str) -> str:
    return extension_path + ".json"


def write_stamp(extension_path: str, record: dict) -> None:
    """Record that the file at ``extension_path`` was built from ``record``."""
    st = os.stat(extension_path)
    with open(stamp_path(extension_path), "w") as f:
        json.dump(dict(record, size=st.st_size, mtime_ns=st.st_mtime_ns), f, indent=1, sort_keys=True)


def stale_because(extension_path: str, record: dict):
    """None when the file at ``extension_path`` was built from ``record``; else why not, in words."""
    if not os.path.exists(extension_path):
        return "not built yet"
    try:
        with open(stamp_path(extension_path)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return "no record of what it was built from"
    st = os.stat(extension_path)
    if (stamp.get("size"), stamp.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return f"{os.path.basename(extension_path)} changed since it was recorded"
    if stamp.get("sources") != record["sources"]:
        return "csrc/ or setup.py changed since the build"
    if stamp.get("torch") != record["torch"]:
        return f"built against torch {stamp.get('torch')}, torch {record['torch']} is installed"
    if stamp.get("cuda") != record["cuda"]:
        return "built with CUDA kernels, now without" if stamp.get("cuda") else "built without CUDA kernels, now with"
    changed = [name for name in BUILD_ENV if stamp.get("env", {}).get(name, "") != record["env"][name]]
    if changed:
        return f"{', '.join(changed)} changed since the build"
    return None


# --- progress: pip -v's output, one line per compiled file --------------------------------

_NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")
_SOURCE = re.compile(r"\s-c\s+([^\s-]\S*)")  # torch's ninja lines say "-c -c /path/file.cpp"


_PIP_SAYS = ("Collecting ", "Installing collected packages", "Successfully installed", "ERROR")


def progress_line(line: str, root: str):
    """What to show of one line of pip -v's output, or None: what pip says without -v (the
    packages it fetches and installs, errors), setup.py's lines about the build, and one
    line per compiled file."""
    line = line.rstrip("\n")
    if line.startswith(_PIP_SAYS):
        return line
    if MESSAGE_PREFIX in line:
        return line[line.index(MESSAGE_PREFIX):]
    step = _NINJA_STEP.match(line)
    if not step:
        return None
    done, total, command = step.groups()
    source = _SOURCE.search(command)
    if source:
        path = source.group(1).strip("'\"")
        what = "compiling " + (os.path.relpath(path, root) if os.path.isabs(path) else path)
    else:
        what = command.split()[0] if command.split() else "a step"
    return f"{MESSAGE_PREFIX}[{done}/{total}] {what}"


def main(argv) -> int:
    if argv[1:2] != ["progress"]:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for line in sys.stdin:
        shown = progress_line(line, root)
        if shown:
            print(shown, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
