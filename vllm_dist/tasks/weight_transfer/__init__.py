"""Weight transfer: move exactly the bytes each inference worker needs from trainer ranks.

See ``/DESIGN.md`` ("Weight transfer"). Producers hold Hugging Face weights (possibly a subset);
consumers give their own loaders, baked once into op chains of pure views; a plan cuts the
needed slices into aligned chunks per gather group and owner class; each sync packs them into
K-slot serve rings and moves them through the communicator (one-sided reads where it has them,
send/recv otherwise).
"""

from vllm_dist.interfaces.dataplane import OneSidedCommunicator, ReadHandle
from vllm_dist.tasks.weight_transfer.config import (
    Fleet,
    Route,
    SyncStats,
    TornModelError,
    TransferConfig,
    UnfilledWeightsError,
    UnservedNameError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
from vllm_dist.tasks.weight_transfer.groups import layer_index, layerwise_groups
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts, build_index
from vllm_dist.tasks.weight_transfer.ops import (
    ALLOWED_OPS,
    BakeError,
    Copy,
    Loader,
    OpChain,
    UnsafeOpError,
    bake,
    check_chain,
    replay,
)
from vllm_dist.tasks.weight_transfer.plan import (
    Chunk,
    LayoutConfig,
    PlanMismatchError,
    Request,
    buffer_alloc_bytes,
    build_chunks,
    pair_digest,
)
from vllm_dist.tasks.weight_transfer.producer import WeightProducer
from vllm_dist.tasks.weight_transfer.ring import (
    FreeBarrier,
    ServeRing,
    TransferStallError,
)
from vllm_dist.tasks.weight_transfer.router import RdtRouter, assign_producer_indices
from vllm_dist.tasks.weight_transfer.source import (
    StateDictSource,
    WeightMeta,
    WeightSource,
    stage_names,
)
from vllm_dist.tasks.weight_transfer.task import ConsumerSpec, JoinSpec, WeightTransferTask
from vllm_dist.versions import RDT_MIN_RAY_VERSION, RayRdtUnavailableError, check_ray_rdt_version

__all__ = [
    "ALLOWED_OPS",
    "RDT_MIN_RAY_VERSION",
    "BakeError",
    "Chunk",
    "ConsumerSpec",
    "Copy",
    "Fleet",
    "FreeBarrier",
    "JoinSpec",
    "LayoutConfig",
    "Loader",
    "ModelIndex",
    "OneSidedCommunicator",
    "OpChain",
    "PlanMismatchError",
    "RayRdtUnavailableError",
    "ProducerFacts",
    "RdtRouter",
    "ReadHandle",
    "Request",
    "Route",
    "ServeRing",
    "StateDictSource",
    "SyncStats",
    "TornModelError",
    "TransferConfig",
    "TransferStallError",
    "UnfilledWeightsError",
    "UnsafeOpError",
    "UnservedNameError",
    "WeightConsumer",
    "WeightMeta",
    "WeightProducer",
    "WeightSource",
    "WeightTransferSetupError",
    "WeightTransferTask",
    "assign_producer_indices",
    "bake",
    "buffer_alloc_bytes",
    "build_chunks",
    "build_index",
    "check_chain",
    "check_ray_rdt_version",
    "layer_index",
    "layerwise_groups",
    "pair_digest",
    "replay",
    "stage_names",
]
