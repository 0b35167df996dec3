"""The GPUs: a port (`GpuPort`) with frozen snapshots, the NVML adapter (`NvmlGpus`, the only
code that imports pynvml, lazily; its telemetry reads and Xid event watch live beside it) and
a timeout guard for calls that hang on a sick GPU. The fake lives in
`appliance.testing.fake_gpus`."""

from appliance.gpu.nvml import NvmlGpus
from appliance.gpu.port import (
    GpuInfo,
    GpuPort,
    GpuProcess,
    GpuSnapshot,
    XidEvent,
    snapshot_with_timeout,
)

__all__ = [
    "GpuInfo",
    "GpuPort",
    "GpuProcess",
    "GpuSnapshot",
    "NvmlGpus",
    "XidEvent",
    "snapshot_with_timeout",
]
