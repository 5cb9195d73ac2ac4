"""A link model: a sync's predicted time from a dry run's pairs, and the link-limited bound.

Each GPU has a NIC (egress and ingress, ``nic_gbs`` each way), NVLink to the GPUs of its node
and its own memory (``local_gbs`` for reads between ranks on one device, ``pack_gbs`` for the
producer's pack copies of chunks of several items). A GPU's time is the larger of its NIC and
NVLink times — they run beside each other, and beside its packs, through the serve ring —
plus its per-chunk costs; on a shared device (every rank on one GPU or one host) its reads
and packs share one memory and add up. The sync takes ``per_sync_s`` (control messages and
the replay launch), the slowest GPU's time, and ``latency_s`` per pipeline round (chunks of the
busiest pair over ``ring_slots``). Rejected: a discrete-event simulation of every chunk, whose
extra detail no measurement we have could check.

The bound is the time the links alone need with a perfect schedule: the consumer that needs
the most bytes over its ingress, or all bytes over the producers' combined egress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vllm_dist.tasks.weight_transfer.dryrun.simulate import DryRun


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """Link and cost parameters; bandwidths in GB/s (1e9 bytes)."""

    nic_gbs: float = 45.0  # per GPU, each way (400 Gb/s RDMA at about 90% of line rate)
    nvlink_gbs: float = 400.0
    local_gbs: float = 1292.0  # a read between ranks on one device
    pack_gbs: float = 1500.0  # a producer's pack copy (HBM read + write)
    gpus_per_node: int = 8
    latency_s: float = 20e-6  # per message round (a network round trip)
    per_chunk_s: float = 2e-6  # the consumer's work per chunk (post a read, unpack launch)
    per_sync_s: float = 0.5e-3  # control messages and the replay launch
    ring_slots: int = 2
    replayed: bool = True  # the steady state: one message per consumer, every read posted at once
    shared_device: bool = False  # every rank on one device (a one-GPU or one-host run)

    def with_bandwidth(self, factor: float) -> LinkModel:
        """Every bandwidth times ``factor`` (a sensitivity check)."""
        return replace(
            self,
            nic_gbs=self.nic_gbs * factor,
            nvlink_gbs=self.nvlink_gbs * factor,
            local_gbs=self.local_gbs * factor,
            pack_gbs=self.pack_gbs * factor,
        )


PRESETS: dict[str, LinkModel] = {
    # inference and trainer GPUs on separate nodes, 400 Gb/s RDMA per GPU
    "h100_rdma": LinkModel(),
    "h200_rdma": LinkModel(local_gbs=1700.0, pack_gbs=2000.0),
    # every rank on one H100: local_gbs and per_sync_s fitted to the raw READs (not the
    # syncs) of 1 GB and 8 GB (t = a + bytes / bw); per_chunk_s assumed
    "h100_one_gpu": LinkModel(
        shared_device=True,
        local_gbs=1382.0,
        pack_gbs=1382.0,
        per_chunk_s=0.3e-6,
        per_sync_s=0.41e-3,
        latency_s=0.0,
    ),
    # every rank on one CPU host (shared memory): local_gbs fitted to the raw READs of 100 and
    # 400 MB; per_sync_s and per_chunk_s fitted to those two syncs (MoE held out)
    "cpu_shm": LinkModel(
        shared_device=True,
        local_gbs=15.7,
        pack_gbs=15.7,
        per_chunk_s=18e-6,
        per_sync_s=0.77e-3,
        latency_s=0.0,
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    """A predicted sync, its bound and where the time goes."""

    predicted_s: float
    bound_s: float
    slowest: str  # which GPU (producer p / consumer c / device) sets the time
    link_s: float  # the slowest GPU's transfer time
    pack_s: float
    chunk_s: float
    rounds: int

    @property
    def over_bound(self) -> float:
        return self.predicted_s / self.bound_s if self.bound_s else math.inf


def predict(run: DryRun, link: LinkModel) -> Prediction:
    """The sync time ``link`` predicts for the pairs ``run`` planned (every replica)."""
    scale = run.scale()
    P = run.num_producers
    need = np.zeros(run.num_consumers, dtype=np.float64)
    chunks_c = np.zeros(run.num_consumers, dtype=np.float64)
    out_p = np.zeros(P, dtype=np.float64)
    pack_p = np.zeros(P, dtype=np.float64)
    rounds = 0
    for pair in run.pairs:
        need[pair.consumer] += pair.nbytes
        chunks_c[pair.consumer] += pair.chunks
        out_p[pair.producer] += pair.nbytes * scale
        pack_p[pair.producer] += pair.packed_bytes * scale
        rounds = max(rounds, 1 if link.replayed else -(-pair.chunks // link.ring_slots))
    total = out_p.sum()
    gb = 1e9
    if link.shared_device:  # one memory serves every read and every pack
        link_s = total / (link.local_gbs * gb)
        pack_s = pack_p.sum() / (link.pack_gbs * gb)
        chunk_s = chunks_c.max(initial=0) * link.per_chunk_s
        busy, slowest = link_s + pack_s + chunk_s, "device"
        bound = total / (link.local_gbs * gb)
    else:  # producers and consumers on separate nodes: every pair crosses a NIC
        prod = np.maximum(out_p / (link.nic_gbs * gb), pack_p / (link.pack_gbs * gb))
        cons = need / (link.nic_gbs * gb) + chunks_c * link.per_chunk_s
        p_max, c_max = int(np.argmax(prod)), int(np.argmax(cons))
        if prod[p_max] >= cons[c_max]:
            busy, slowest = float(prod[p_max]), f"producer {p_max}"
        else:
            busy, slowest = float(cons[c_max]), f"consumer {c_max}"
        link_s = max(out_p.max() / (link.nic_gbs * gb), need.max() / (link.nic_gbs * gb))
        pack_s = float(pack_p.max() / (link.pack_gbs * gb))
        chunk_s = float(chunks_c.max() * link.per_chunk_s)
        bound = max(need.max(), total / P) / (link.nic_gbs * gb)
    predicted = link.per_sync_s + busy + rounds * link.latency_s
    return Prediction(
        predicted_s=predicted,
        bound_s=float(bound),
        slowest=slowest,
        link_s=float(link_s),
        pack_s=float(pack_s),
        chunk_s=float(chunk_s),
        rounds=rounds,
    )


def fsdp_gather_s(model_bytes: int, producers: int, link: LinkModel) -> float:
    """Seconds a hierarchical FSDP all-gather of the whole model takes on each producer's NIC
    (the trainer's cost before it can serve; outside the predicted sync)."""
    nodes = max(1, -(-producers // link.gpus_per_node))
    if nodes == 1:
        return model_bytes * (producers - 1) / producers / (link.nvlink_gbs * 1e9)
    per_nic = model_bytes * (nodes - 1) / nodes / link.gpus_per_node
    return per_nic / (link.nic_gbs * 1e9)
