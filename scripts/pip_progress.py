"""What scripts/setup.sh shows while pip installs.

    pip install -v ... 2>&1 | python scripts/pip_progress.py

reads pip's verbose output and prints what pip says without -v (the packages it
collects, downloads and installs, errors), the build's own lines (setup.py's
``ddpx._C: `` lines, see scripts/extension_build.py), one line per compiled file (ninja's
``[n/N]`` steps, printed when a file is compiled), and, when none of that came for 9 s,
a line saying what pip is still doing and for how long: set-up is never silent for 10 s
(a download of torch, installing many packages).
"""

import os
import queue
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extension_build import HEARTBEAT_S, MESSAGE_PREFIX, duration  # noqa: E402

_PIP_SAYS = ("Collecting ", "Downloading ", "Installing collected packages", "Successfully installed", "ERROR")
_NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.*)$")
_SOURCE = re.compile(r"\s-c\s+([^\s-]\S*)")  # torch's ninja lines say "-c -c /path/file.cpp"
# what pip is doing, from a line of its verbose output (the first pattern that matches)
_PHASES = (
    (re.compile(r"^Collecting (\S+)"), lambda m: f"collecting {m[1]}"),
    (re.compile(r"^Processing (\S+)"), lambda m: f"processing {os.path.basename(m[1])}"),
    (re.compile(r"^Downloading (\S+)(?: \((.+)\))?"),
     lambda m: f"downloading {m[1].rsplit('/', 1)[-1]}" + (f" ({m[2]})" if m[2] else "")),
    (re.compile(r"^Installing collected packages: (.*)"),
     lambda m: f"installing {len(m[1].split(','))} package" + ("s" if "," in m[1] else "")),
    (re.compile(r"^(?:Obtaining|Preparing|Getting requirements|Checking if build backend|Building editable|"
                r"Building wheel)"), lambda m: "preparing the build"),
    (re.compile(r"running build_ext"), lambda m: "building ddpx._C"),
    (re.compile(r"^Successfully installed"), lambda m: "finishing"),
)


class Progress:
    """The filter's state: what it last printed when, and what pip is doing since when."""

    def __init__(self, root: str, clock=time.monotonic):
        self.root, self.clock = root, clock
        self.phase, self.phase_since = "starting pip", clock()
        self.spoke_at = clock()

    def feed(self, line: str):
        """What to print for one line of pip -v's output, or None."""
        line = line.rstrip("\n")
        for pattern, phase in _PHASES:
            match = pattern.search(line.strip())
            if match:
                self.phase, self.phase_since = phase(match), self.clock()
                break
        shown = self._shown(line)
        if shown:
            self.spoke_at = self.clock()
        return shown

    def _shown(self, line: str):
        if line.lstrip().startswith(_PIP_SAYS):
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
            what = "compiled " + (os.path.relpath(path, self.root) if os.path.isabs(path) else path)
        else:
            what = command.split()[0] if command.split() else "a step"
        return f"{MESSAGE_PREFIX}[{done}/{total}] {what}"

    def quiet_for(self) -> float:
        """Seconds until a heartbeat is due: 9/10 of HEARTBEAT_S, a margin for a busy machine's delays."""
        return max(0.0, self.spoke_at + 0.9 * HEARTBEAT_S - self.clock())

    def heartbeat(self) -> str:
        self.spoke_at = self.clock()
        return f"setup.sh: still {self.phase} ({duration(self.clock() - self.phase_since)})"


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = queue.Queue()

    def read():
        for line in sys.stdin:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    progress = Progress(root)
    while True:
        try:
            line = lines.get(timeout=progress.quiet_for())
        except queue.Empty:
            print(progress.heartbeat(), flush=True)
            continue
        if line is None:
            return 0
        shown = progress.feed(line)
        if shown:
            print(shown, flush=True)


if __name__ == "__main__":
    sys.exit(main())
