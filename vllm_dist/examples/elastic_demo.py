"""An elastic fleet of the CPU demo's Llama: producers that keep syncing while consumer
launches (a TP replica each) join, die and come back; every consumer verifies every sync.

``ElasticLlamaTask`` is ``ElasticTransferTask`` with ``LlamaTransferTask``'s hooks (weights
change before every sync, consumers check every parameter byte for byte).
"""

from __future__ import annotations

from vllm_dist.examples.weight_sync_demo import LlamaTransferTask
from vllm_dist.tasks.weight_transfer.elastic_task import ElasticTransferTask


class ElasticLlamaTask(ElasticTransferTask, LlamaTransferTask):
    """The demo Llama over an elastic fleet (see ``ElasticTransferTask`` for the keywords)."""
