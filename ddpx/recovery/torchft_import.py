"""torchft, imported where ``elastic.recovery: live`` needs it (the launcher, ``ddpx lighthouse``,
the workers): the module, or one line saying how to install it."""

from __future__ import annotations

from ..errors import DdpxError

TORCHFT_PIN = "torchft-nightly==2026.10.26"  # setup.py's extra "ft"


def require_torchft(what: str):
    """The ``torchft`` module; a one-line :class:`DdpxError` naming ``what`` needs it when it is
    not installed (or does not import)."""
    try:
        import torchft
    except ModuleNotFoundError as exc:
        if exc.name != "torchft":  # installed, but something it imports is missing
            raise DdpxError(f"{what} needs torchft, which is installed but does not import "
                            f"(no module named {exc.name!r}): pip install 'ddpx[ft]' ({TORCHFT_PIN})") from None
        raise DdpxError(f"{what} needs torchft, which is not installed: pip install 'ddpx[ft]' "
                        f"({TORCHFT_PIN})") from None
    except ImportError as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DdpxError(f"{what} needs torchft, which is installed but does not import ({why}): "
                        f"pip install 'ddpx[ft]' ({TORCHFT_PIN})") from None
    return torchft
