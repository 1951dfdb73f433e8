"""torchft is an optional extra: one line with the install command when it is missing."""

from ..errors import DdpxError


def require_torchft(what: str):
    try:
        import torchft
    except ImportError:
        raise DdpxError(f"{what} needs torchft, which is not installed: pip install 'ddpx[ft]' "
                        "(torchft-nightly==2026.10.26)") from None
    return torchft
