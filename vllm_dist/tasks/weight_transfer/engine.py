"""Old import path of the engines; they live in ``producer.py`` and ``consumer.py`` now."""

from vllm_dist.tasks.weight_transfer.config import (
    Fleet,
    Route,
    SyncStats,
    TransferConfig,
    UnservedNameError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
from vllm_dist.tasks.weight_transfer.producer import WeightProducer

__all__ = [
    "Fleet",
    "Route",
    "SyncStats",
    "TransferConfig",
    "UnservedNameError",
    "WeightConsumer",
    "WeightProducer",
    "WeightTransferSetupError",
]
