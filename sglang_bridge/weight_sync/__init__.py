"""Push trainer weights (HF names) into running SGLang servers.

    manifest = Manifest.from_checkpoint(served_model_path)            # what the servers hold
    sync = DistributedWeightSynchronizer([srv.url], manifest)          # gloo on CPU, nccl on GPU
    sync.connect()                                                     # /init_weights_update_group
    report = sync.sync(hf_named_tensors, version="step-1")             # one full update
    sync.verify(prompts, reference_logprobs)                           # max |delta logp| vs trainer
    sync.close()

Rooms: :mod:`~sglang_bridge.weight_sync.interface` (the :class:`WeightSynchronizer` interface, its
reports and errors), :mod:`~sglang_bridge.weight_sync.manifest` (what the servers hold, and the check
of an update against it), :mod:`~sglang_bridge.weight_sync.update_group` (the update group's
rendezvous on torch's private group factory), :mod:`~sglang_bridge.weight_sync.buckets` (wire
entries incl. FP8, flattened buckets, the packer thread and its two send buffers),
:mod:`~sglang_bridge.weight_sync.server_calls` (the HTTP calls to the servers on a private event-loop
thread), :mod:`~sglang_bridge.weight_sync.verify` (verify mode), and one file per transport:
:mod:`~sglang_bridge.weight_sync.distributed` (the NCCL / gloo broadcast, with the lifecycle of one
update: validate, open, send, close, or fail).
"""

from sglang_bridge.weight_sync.buckets import StreamMismatchError
from sglang_bridge.weight_sync.control import ControlStore
from sglang_bridge.weight_sync.distributed import DistributedWeightSynchronizer
from sglang_bridge.weight_sync.interface import (
    ReferenceLogprobs,
    SyncReport,
    VerifyReport,
    WeightSyncError,
    WeightSynchronizer,
    WeightSyncTimeoutError,
)
from sglang_bridge.weight_sync.manifest import Manifest, ManifestMismatchError, TensorSpec
from sglang_bridge.weight_sync.source import WeightSource
from sglang_bridge.weight_sync.update_group import broadcast_async, create_update_group, host_update_store

__all__ = [
    "ControlStore",
    "DistributedWeightSynchronizer",
    "Manifest",
    "ManifestMismatchError",
    "ReferenceLogprobs",
    "StreamMismatchError",
    "SyncReport",
    "TensorSpec",
    "VerifyReport",
    "WeightSource",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WeightSynchronizer",
    "broadcast_async",
    "create_update_group",
    "host_update_store",
]
