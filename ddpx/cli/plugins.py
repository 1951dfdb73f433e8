"""``ddpx plugins``: the plugins a run would load, with distribution, version and hooks."""

import json

from ..config import read_config, split_config_and_overrides
from ..config.strategies import BUILTIN_STRATEGIES, installed_strategies, strategy_import_path
from ..plugin.manager import plugin_table


def register(subparsers):
    p = subparsers.add_parser(
        "plugins",
        help="list loaded plugins (entry points of group 'ddpx' and plugins.enable) and their hooks",
        description="Plugins in registration order; a later plugin's hooks run first, the trainer's last. "
                    "Then the run's strategy (trainer.strategy) and the strategies there are to choose from.",
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config whose plugins section to apply")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. plugins.block=[amp]")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=run)


def run(args):
    config_path, overrides = split_config_and_overrides(args.config, args.overrides)
    config = read_config(config_path, overrides)  # the plugins and the strategy's name: no target imported
    rows = plugin_table(config.plugin_manager)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    dist_width = max(len(f"{r['distribution']} {r['version']}") for r in rows)
    for r in rows:
        dist = f"{r['distribution']} {r['version']}"
        print(f"{r['name']:<{width}}  {dist:<{dist_width}}  {', '.join(h for h in r['hooks'])}")
    print(strategy_line(config.trainer.strategy))
    return 0


def strategy_line(name: str) -> str:
    """``strategy: NAME (module.Class); built in: ddp, fsdp; installed: NAME (distribution version), ...``."""
    installed = [f"{n} ({ep.dist.name} {ep.dist.version})" if ep.dist else n
                 for n, ep in sorted(installed_strategies().items()) if n not in BUILTIN_STRATEGIES]
    return (f"strategy: {name} ({strategy_import_path(name)}); built in: {', '.join(BUILTIN_STRATEGIES)}; "
            f"installed: {', '.join(installed) or 'none'}")
