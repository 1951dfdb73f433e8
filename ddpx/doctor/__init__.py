"""``ddpx doctor``: find the usual distributed-training failures before a run does.

One module a job:

* :mod:`~ddpx.doctor.checks`: the pure checks, each a function of its inputs
  returning :class:`Check` objects (tests feed them any situation);
* :mod:`~ddpx.doctor.facts`: :func:`gather_facts` collects this machine's real
  inputs (through the probes of :mod:`ddpx.net`) and :func:`run_checks` feeds
  them to the checks;
* :mod:`~ddpx.doctor.probe`: ``--collectives``, real collectives between
  local processes and a consistency check of every comm hook;
* :mod:`~ddpx.doctor.report`: the text, the JSON summary and the exit code.
"""

from .checks import (DEFAULT_MASTER_PORT, FAIL, OK, SAFE_PORT_MIN, WARN, Check, check_backend, check_hostname,
                     check_interface, check_master_address, check_master_port, check_nccl_hints, check_port_range,
                     check_store_host, check_versions)
from .probe import COLLECTIVE_BYTES, run_collectives
from .facts import Facts, gather_facts, run_checks, suggested_iface
from .report import exit_code, format_text, summarize

__all__ = [
    "DEFAULT_MASTER_PORT", "FAIL", "OK", "SAFE_PORT_MIN", "WARN", "Check", "check_backend", "check_hostname",
    "check_interface", "check_master_address", "check_master_port", "check_nccl_hints", "check_port_range",
    "check_store_host", "check_versions", "COLLECTIVE_BYTES", "run_collectives", "Facts", "gather_facts",
    "run_checks", "suggested_iface", "exit_code", "format_text", "summarize",
]
