"""The dying words the engine emulator prints: SGLang-shaped tracebacks for its injected
faults. A test and demo instrument (`appliance.testing.fake_sglang`); the file paths are where
the appliance installs the real engine, the line numbers SGLang 0.5.23's.
"""

from __future__ import annotations

from appliance.testing.fake_sglang.logwriter import stamp
from appliance.testing.fake_sglang.memory import BASELINE_GB, WEIGHTS_GB, Capacity

SITE = "/opt/appliance/engine/lib/python3.12/site-packages/sglang"
WEIGHT_UTILS = f"{SITE}/srt/model_loader/weight_utils.py"
SCHEDULER_FRAMES = f"""Traceback (most recent call last):
  File "{SITE}/srt/managers/scheduler.py", line 6360, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "{SITE}/srt/managers/scheduler.py", line 612, in __init__
    self.init_model_worker()
"""
LOAD_FRAMES = f"""  File "{SITE}/srt/model_executor/model_runner.py", line 1301, in load_model
    self.model = self.loader.load_model(
                 ^^^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/srt/model_loader/loader.py", line 640, in load_weights_and_postprocess
    model.load_weights(weights)
"""
ITERATOR = "multi_thread_safetensors_weights_iterator"
CORRUPT_FRAMES = f"""  File "{WEIGHT_UTILS}", line 1380, in {ITERATOR}
    for name, param in future.result():
                       ^^^^^^^^^^^^^^^
  File "{WEIGHT_UTILS}", line 1352, in _load_file
    with safe_open(st_file, framework="pt") as f:
         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
safetensors_rust.SafetensorError: Error while deserializing header: MetadataIncompleteBuffer
"""
GPU_FAULT_FRAMES = f"""  File "{SITE}/srt/models/kimi_k3.py", line 3611, in load_weights
    weight_loader(param, loaded_weight, shard_id)
  File "{SITE}/srt/layers/moe/fused_moe_triton/layer.py", line 902, in weight_loader
    expert_data.copy_(loaded_weight)
RuntimeError: CUDA error: unspecified launch failure
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace \
below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
"""
POOL_FRAMES = f"""  File "{SITE}/srt/managers/scheduler.py", line 1132, in init_memory_pools
    self.kv_cache_configurator.configure()
  File "{SITE}/srt/mem_cache/kv_cache_configurator.py", line 3060, in _resolve_memory_pool_config
    total_rest_memory = self._handle_max_mamba_cache(total_rest_memory)
                        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
"""
KV_ALLOC_FRAMES = f"""  File "{SITE}/srt/managers/scheduler.py", line 1132, in init_memory_pools
    self.kv_cache_configurator.configure()
  File "{SITE}/srt/mem_cache/memory_pool.py", line 2080, in _create_buffers
    torch.zeros(
"""
MAIN_FRAMES = f"""Traceback (most recent call last):
  File "/opt/appliance/engine/bin/sglang", line 10, in <module>
    sys.exit(main())
             ^^^^^^
  File "{SITE}/cli/serve.py", line 224, in serve
    registered.backend.run(request)
  File "{SITE}/srt/entrypoints/engine.py", line 1349, in _launch_subprocesses
    scheduler_infos = _wait_for_scheduler_ready(scheduler_pipe_readers, scheduler_procs)
                      ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/srt/entrypoints/engine.py", line 2040, in _wait_for_scheduler_ready
    raise _scheduler_died_error(j, scheduler_procs[j])
"""


def _scheduler_line(rank: int, body: str) -> str:
    return f"[{stamp()} TP{rank}] Scheduler hit an exception: {body}"


def scheduler_exception(rank: int, kind: str, message: str = "") -> str:
    """`Scheduler hit an exception: <traceback>`: a GPU fault while copying weights
    (`crash`, worth a retry), a corrupt shard (`corrupt`, not worth one), or a pool sizing
    error (`capacity`, with SGLang's own words in `message`)."""
    if kind == "crash":
        return _scheduler_line(rank, SCHEDULER_FRAMES + LOAD_FRAMES + GPU_FAULT_FRAMES)
    if kind == "corrupt":
        return _scheduler_line(rank, SCHEDULER_FRAMES + LOAD_FRAMES + CORRUPT_FRAMES)
    return _scheduler_line(rank, SCHEDULER_FRAMES + POOL_FRAMES + f"RuntimeError: {message}\n")


def oom_exception(rank: int, cap: Capacity) -> str:
    total = BASELINE_GB + cap.pre_load_avail_gb
    in_use = BASELINE_GB + WEIGHTS_GB + cap.state_gb
    free = round(cap.kv_gb * 0.6, 2)  # less than the request, or it would not have failed
    return _scheduler_line(
        rank,
        SCHEDULER_FRAMES + KV_ALLOC_FRAMES
        + f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {cap.kv_gb:.2f} GiB. "
        f"GPU {rank} has a total capacity of {total:.2f} GiB of which {free:.2f} GiB is free. "
        f"Including non-PyTorch memory, this process has {total - free:.2f} GiB memory in use. "
        f"Of the allocated memory {in_use - 0.5:.2f} GiB is allocated by PyTorch, and 512.00 MiB "
        f"is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        f"try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
        f"See documentation for Memory Management  "
        f"(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n",
    )


def scheduler_died(rank: int, exit_code: int) -> str:
    """The main process's uncaught exception when a rank dies during initialization
    (engine.py `_scheduler_died_error`)."""
    return (
        MAIN_FRAMES
        + f"RuntimeError: Rank {rank} scheduler died during initialization (exit code: "
        f"{exit_code}). If exit code is -9 (SIGKILL), a common cause is the OS OOM killer. "
        f"Run `dmesg -T | grep -i oom` to check.\n"
    )
