"""appliance: runs Kimi K3 on one 8x B300 box through SGLang, behind an admin console."""

__version__ = "0.1.0"
