"""The run's configuration, from YAML to a validated :class:`Config`.

* :mod:`.schema`: ddpx's own sections, their defaults, key types, choices and ranges;
* :mod:`.loader`: the file, ``key=value`` overrides, the plugins' sections, validation
  (:func:`load_config` does it all, in the launcher and again in every rank; :func:`read_config`
  the checks that import none of the run's code, torch included);
* :mod:`.paths`: where a run writes (``run_dir``) and imports the user's modules from;
* ``default.yaml``: the built-in run (an MLP on the UCI digits).
"""

from .loader import Config, load_config, read_config, split_config_and_overrides
from .paths import default_run_dir, user_module_dirs
from .schema import check_nproc

__all__ = ["Config", "load_config", "read_config", "split_config_and_overrides", "default_run_dir", "user_module_dirs",
           "check_nproc"]
