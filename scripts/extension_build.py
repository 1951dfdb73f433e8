"""The C++ extension's build: what ddpx._C was built from, and its progress on a terminal.

setup.py (loaded by path) records, next to the in-place extension (``ddpx/_C.<abi>.so``),
what it was built from: a hash of setup.py, this file and every file under csrc/, the
torch version, whether it has CUDA kernels, and the compiler settings from the
environment, with the file's size and mtime. When all of that still matches, a build
(``pip install -e .``, ``python setup.py build_ext --inplace``) reuses the file instead of
compiling for minutes again: a second ``scripts/setup.sh`` in the same checkout, or one
into another venv with the same torch. Deleting ``ddpx/_C*.so`` forces a fresh build.

While it compiles, setup.py prints a line at least every 10 s (:class:`CompileHeartbeat`):
the files a compiler has open and how many are done. ninja names a file only when it is
compiled, and the first ones take minutes (they include torch's extension headers).
"""

import glob
import hashlib
import json
import os
import threading
import time

# the environment a compile reads beyond the sources and torch: a change means a rebuild
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "TORCH_CUDA_ARCH_LIST", "NVCC_FLAGS")
MESSAGE_PREFIX = "ddpx._C: "  # setup.py's lines about the build; scripts/pip_progress.py passes them on


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


# --- while it compiles: a line at least every HEARTBEAT_S ---------------------------------

HEARTBEAT_S = 10  # the longest silence of a set-up (each printer speaks a little sooner)
SOURCE_SUFFIXES = (".cpp", ".cu")


def duration(seconds: float) -> str:
    """``40 s``, ``3 min 5 s``."""
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def compiling_now(root: str, proc: str = "/proc") -> list:
    """The sources under ``root``/csrc a compiler has open now (the command lines in /proc; none
    where there is no /proc): ninja names a file only once it is compiled, and the first ones,
    which include torch's extension headers, take minutes."""
    csrc = os.path.join(root, "csrc") + os.sep
    found = set()
    for cmdline in glob.glob(os.path.join(proc, "[0-9]*", "cmdline")):
        try:
            with open(cmdline, "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:  # the process ended meanwhile
            continue
        if "-c" in args:
            found.update(os.path.relpath(a, root) for a in args if a.startswith(csrc) and a.endswith(SOURCE_SUFFIXES))
    return sorted(found)


class CompileHeartbeat:
    """``with CompileHeartbeat(root, objects_dir, total):`` prints, every ``every`` s while the
    block runs, which files are compiling, how many of ``total`` are done (object files under
    ``objects_dir`` written since the start) and for how long."""

    def __init__(self, root: str, objects_dir: str, total: int, every: float = HEARTBEAT_S - 2, proc: str = "/proc"):
        self.root, self.objects_dir, self.total, self.every, self.proc = root, objects_dir, total, every, proc
        self.stop = threading.Event()
        self.start = time.time()

    def __enter__(self):
        self.start = time.time()
        self.thread = threading.Thread(target=self._run, name="compile heartbeat", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def line(self) -> str:
        done = 0
        for obj in glob.glob(os.path.join(self.objects_dir, "**", "*.o"), recursive=True):
            try:
                done += os.stat(obj).st_mtime >= self.start
            except OSError:
                pass
        files = compiling_now(self.root, self.proc)
        doing = "linking" if not files and done >= self.total else f"compiling {', '.join(files)}".rstrip()
        return f"{MESSAGE_PREFIX}{doing} ({done} of {self.total} done, {duration(time.time() - self.start)})"

    def _run(self):
        while not self.stop.wait(self.every):
            print(self.line(), flush=True)
