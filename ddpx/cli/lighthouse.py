"""``ddpx lighthouse``: the server the replica groups of a live run (``elastic.recovery: live``)
agree on a quorum through (torchft's Lighthouse; ddpx/recovery/lighthouse.py)."""

from ..recovery import lighthouse


def register(subparsers):
    p = subparsers.add_parser(
        "lighthouse",
        help="run torchft's Lighthouse for a live run (elastic.recovery: live): start it first, then "
             "`ddpx train CONFIG --lighthouse HOST:PORT` on every node",
        description=(
            "Run torchft's Lighthouse, which the replica groups of a live run (elastic.recovery: live; every node "
            "its own group) ask for a quorum each step. It runs until SIGTERM (exit 0) or Ctrl-C (exit 130). "
            "Needs torchft: pip install 'ddpx[ft]'."
        ),
    )
    p.add_argument("--port", type=int, default=lighthouse.DEFAULT_PORT,
                   help=f"port to listen on (default: {lighthouse.DEFAULT_PORT})")
    p.add_argument("--bind", default=lighthouse.DEFAULT_BIND,
                   help="address to listen on (default: 0.0.0.0, every IPv4 interface)")
    p.add_argument("--min-groups", type=int, default=1,
                   help="replica groups (nodes) a quorum needs (default: 1)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=lighthouse.DEFAULT_HEARTBEAT_TIMEOUT_S,
                   help="seconds without a heartbeat after which a group leaves the quorum (default: 5, "
                        "torchft's; 1 detects a dead node in about 1 s)")
    p.add_argument("--join-timeout-s", type=float, default=lighthouse.DEFAULT_JOIN_TIMEOUT_S,
                   help="seconds a quorum waits, once --min-groups joined, for the other groups that heartbeat "
                        f"to join too (default: {lighthouse.DEFAULT_JOIN_TIMEOUT_S:g}; a quorum that every "
                        "heartbeating group joined forms at once)")
    p.add_argument("--quorum-tick-ms", type=int, default=None,
                   help=f"how often, in ms, the quorum is checked (default: torchft's, "
                        f"{lighthouse.TORCHFT_QUORUM_TICK_MS})")
    p.set_defaults(func=run)


def run(args) -> int:
    return lighthouse.serve(port=args.port, bind=args.bind, min_groups=args.min_groups,
                            heartbeat_timeout_s=args.heartbeat_timeout_s, join_timeout_s=args.join_timeout_s,
                            quorum_tick_ms=args.quorum_tick_ms)
