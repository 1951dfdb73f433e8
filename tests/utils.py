"""Shared helpers for multi-process tests: free ports and the ``ddpx`` CLI in a subprocess.

Every helper has a hard timeout so a hung collective fails the test instead of
stalling the suite.
"""

import os
import subprocess
import sys


from ddpx.launch import free_port  # noqa: F401  (tests import it from here)


def run_cli(args, timeout=120, env=None, cwd=None, python=None):
    """Run ``python -m ddpx ARGS`` and return ``(returncode, stdout, stderr)``.

    ``env`` entries are added to the current environment; ``python`` selects an
    interpreter (e.g. a test venv's). The whole process group is killed when
    ``timeout`` seconds pass, and the test fails with what the run printed so far.
    """
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # 2 cores, several ranks: avoid oversubscription
    full_env.update(env or {})
    cmd = [python or sys.executable, "-m", "ddpx", *map(str, args)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # so a timeout can kill torchrun and its workers together
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(
            f"`ddpx {' '.join(map(str, args))}` did not finish within {timeout} s\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
        )
    return proc.returncode, out, err
