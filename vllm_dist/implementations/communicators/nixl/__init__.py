"""The NIXL_RDT communicator: NIXL agents for point-to-point and one-sided transfers, and the
Ray Direct Transport helpers. See ``communicator`` for the design."""

from vllm_dist.implementations.communicators.nixl.agent import (
    CUDA_IPC_GET_ZCOPY,
    INSTALL_HINT,
    NixlOptions,
    NixlProtocolError,
    NixlTimeoutError,
    NixlTransferError,
    ReadOnlyExposureError,
)
from vllm_dist.implementations.communicators.nixl.communicator import NixlRdtCommunicator
from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer
from vllm_dist.implementations.communicators.nixl.mapping import CudaIpcHandle, SharedMemoryHandle
from vllm_dist.implementations.communicators.nixl.network import (
    listening_sockets,
    nixl_listens_on,
)
from vllm_dist.implementations.communicators.nixl.onesided import strided_runs
from vllm_dist.implementations.communicators.nixl.ray_rdt import (
    prepare_ray_rdt_actor,
    ray_rdt_env,
    ray_rdt_fetch_into,
    ray_rdt_register,
    ray_rdt_wait_lendable,
)
from vllm_dist.implementations.communicators.nixl.transfers import NixlTransfer, PreparedReads
from vllm_dist.versions import RDT_MIN_RAY_VERSION, RayRdtUnavailableError, check_ray_rdt_version

__all__ = [
    "CUDA_IPC_GET_ZCOPY",
    "INSTALL_HINT",
    "RDT_MIN_RAY_VERSION",
    "CudaIpcHandle",
    "ExposedBuffer",
    "NixlOptions",
    "NixlProtocolError",
    "NixlRdtCommunicator",
    "NixlTimeoutError",
    "NixlTransfer",
    "NixlTransferError",
    "PreparedReads",
    "RayRdtUnavailableError",
    "ReadOnlyExposureError",
    "SharedMemoryHandle",
    "check_ray_rdt_version",
    "listening_sockets",
    "nixl_listens_on",
    "prepare_ray_rdt_actor",
    "ray_rdt_env",
    "ray_rdt_fetch_into",
    "ray_rdt_register",
    "ray_rdt_wait_lendable",
    "strided_runs",
]
