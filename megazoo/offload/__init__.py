"""The pure rules of optimizer offload, below both the engine (`training/backends`) and the
planner (`plan/`), so that the two cannot disagree: `bytes.py` (where the bytes go: GPU,
host memory, disk; the constants), `buckets.py` (the gradient buckets and which of them go
to the host), `checks.py` (the host, the disk and --nvme-path checked before training).
Nothing here allocates or imports the engine or the planner.
"""
from .buckets import BucketSpan, bucket_elements_of, bucket_spans, host_share, host_slots
from .bytes import (DISK_ALIGN, GB, HOST_RESERVE, STATE_BYTES, STORE_SLOTS, TRANSFER_BUCKETS,
                    UP_BUFFERS, WIRE_BYTES, HostSplit, OffloadBytes, disk_span, host_split,
                    offload_bytes, pinned, split_budget)
from .checks import check_nvme_path, check_offload_plan, gb_text, host_memory_bytes

__all__ = ["BucketSpan", "bucket_elements_of", "bucket_spans", "host_share", "host_slots",
           "DISK_ALIGN", "GB", "HOST_RESERVE", "STATE_BYTES", "STORE_SLOTS", "TRANSFER_BUCKETS",
           "UP_BUFFERS", "WIRE_BYTES", "HostSplit", "OffloadBytes", "disk_span", "host_split",
           "offload_bytes", "pinned", "split_budget", "check_nvme_path", "check_offload_plan",
           "gb_text", "host_memory_bytes"]
