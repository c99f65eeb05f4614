"""mHC ops. Only the torch reference exists so far."""

from hylo.ops.mhc.reference import mhc_post, mhc_pre

__all__ = ["mhc_post", "mhc_pre"]
