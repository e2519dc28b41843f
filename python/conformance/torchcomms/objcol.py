"""torchcomms.objcol is ftcomm.objcol."""

from ftcomm.objcol import *  # noqa: F401,F403
