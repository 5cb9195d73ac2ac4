"""Find, load and bind libnccl through ctypes: one table of functions, one error check.

Where the library comes from, first match wins:

1. an explicit ``path`` argument;
2. the ``VLLM_DIST_NCCL_SO_PATH`` environment variable;
3. the copy that ships with torch (``torch/lib/libnccl.so*``) or with the ``nvidia-nccl-cu12`` /
   ``nvidia-nccl-cu13`` wheels (``site-packages/nvidia/{nccl,cu12,cu13}/lib/libnccl.so.2``);
4. the system's ``libnccl.so.2`` (the dynamic loader's search path).

An explicit path or the variable is a statement of intent: when it fails to load, the error says
so instead of silently falling back. ``NcclLibrary.source`` and ``.attempts`` record which
candidate was loaded and why each earlier one was passed over.

Nothing here creates a CUDA context: ``dlopen`` of libnccl, ``ncclGetVersion``,
``ncclGetErrorString`` and ``ncclGetUniqueId`` run without a GPU, so they are tested on CPU.

Rejected alternatives:

- ``cupy.cuda.nccl``: a large extra dependency whose NCCL build is fixed by the cupy wheel, so
  the NCCL version cannot be swapped, and its calls go through cupy's own stream objects.
- ``torch.distributed``'s ``ProcessGroupNCCL``: its NCCL is linked into the torch build (no
  version swap), it owns a watchdog thread and work objects per call, and it is the backend this
  one is measured against; calling it from here would make the comparison meaningless.
- A compiled extension (pybind11 / cffi API mode): needs a compiler and NCCL headers at install
  time and pins one NCCL ABI; the NCCL API used here is plain C with stable prototypes, which
  ctypes binds at run time.
"""

from __future__ import annotations

import ctypes
import enum
import glob
import importlib.util
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_dist.interfaces import BackendUnavailableError

if TYPE_CHECKING:
    import torch

ENV_VAR = "VLLM_DIST_NCCL_SO_PATH"
SONAME = "libnccl.so.2"
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
INSTALL_HINT = (
    f"install the NCCL wheel matching your CUDA (pip install nvidia-nccl-cu13, or "
    f"nvidia-nccl-cu12 for CUDA 12) or set {ENV_VAR}=/path/to/{SONAME}"
)


# -- C types ----------------------------------------------------------------------------------
ncclResult_t = ctypes.c_int
ncclComm_t = ctypes.c_void_p
ncclDataType_t = ctypes.c_int
ncclRedOp_t = ctypes.c_int
cudaStream_t = ctypes.c_void_p
buffer_t = ctypes.c_void_p


class NcclUniqueId(ctypes.Structure):
    """``typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;``"""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(self.internal)

    @classmethod
    def from_bytes(cls, data: bytes) -> NcclUniqueId:
        if not isinstance(data, (bytes, bytearray)) or len(data) != UNIQUE_ID_BYTES:
            raise ValueError(
                f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got "
                f"{len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__}"
            )
        uid = cls()
        ctypes.memmove(uid.internal, bytes(data), UNIQUE_ID_BYTES)
        return uid


class NcclResult(enum.IntEnum):
    """``ncclResult_t``."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
    TIMEOUT = 8


class NcclDataType(enum.IntEnum):
    """``ncclDataType_t``; BFLOAT16 needs NCCL >= 2.10, the FP8 types NCCL >= 2.24."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8_E4M3 = 10
    FLOAT8_E5M2 = 11

    @property
    def min_version(self) -> tuple[int, int, int]:
        if self is NcclDataType.BFLOAT16:
            return (2, 10, 0)
        if self in (NcclDataType.FLOAT8_E4M3, NcclDataType.FLOAT8_E5M2):
            return (2, 24, 0)
        return (2, 0, 0)


class NcclRedOp(enum.IntEnum):
    """``ncclRedOp_t`` (the built-in ones); AVG needs NCCL >= 2.10."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4

    @property
    def min_version(self) -> tuple[int, int, int]:
        return (2, 10, 0) if self is NcclRedOp.AVG else (2, 0, 0)


# torch dtype name -> NCCL type. Names, not torch objects, so that this module imports without
# torch and a torch build lacking a dtype (old uint32, fp8) simply never matches it.
_TORCH_DTYPES: dict[str, NcclDataType] = {
    "int8": NcclDataType.INT8,
    "uint8": NcclDataType.UINT8,
    "int32": NcclDataType.INT32,
    "uint32": NcclDataType.UINT32,
    "int64": NcclDataType.INT64,
    "uint64": NcclDataType.UINT64,
    "float16": NcclDataType.FLOAT16,
    "float32": NcclDataType.FLOAT32,
    "float64": NcclDataType.FLOAT64,
    "bfloat16": NcclDataType.BFLOAT16,
    "float8_e4m3fn": NcclDataType.FLOAT8_E4M3,
    "float8_e5m2": NcclDataType.FLOAT8_E5M2,
}


def nccl_dtype(dtype: torch.dtype, version: tuple[int, int, int]) -> NcclDataType:
    """The NCCL type that reduces ``dtype`` under NCCL ``version``.

    Raises:
        ValueError: NCCL has no such type, or this NCCL is too old for it; the message lists the
            dtypes that work and what to do instead.
    """
    name = str(dtype).removeprefix("torch.")
    found = _TORCH_DTYPES.get(name)
    if found is None:
        ok = ", ".join(n for n, t in _TORCH_DTYPES.items() if version >= t.min_version)
        raise ValueError(
            f"NCCL {_fmt(version)} cannot reduce {dtype}; it reduces {ok}. Cast the tensor "
            "(e.g. .float()) before a reduction; data-movement ops (all_gather, broadcast, "
            "send/recv) move any dtype"
        )
    if version < found.min_version:
        raise ValueError(
            f"{dtype} needs NCCL >= {_fmt(found.min_version)}, this library is "
            f"{_fmt(version)}; load a newer one ({INSTALL_HINT})"
        )
    return found


def torch_dtype_table(version: tuple[int, int, int]) -> dict[torch.dtype, NcclDataType]:
    """Every torch dtype that NCCL ``version`` reduces natively, for O(1) look-ups on hot paths."""
    import torch

    return {
        getattr(torch, name): t
        for name, t in _TORCH_DTYPES.items()
        if hasattr(torch, name) and version >= t.min_version
    }


def nccl_red_op(op: str, version: tuple[int, int, int]) -> NcclRedOp:
    """The NCCL reduction for a ``ReduceOp`` value (``"sum"``, ``"product"``, ...)."""
    mapping = {
        "sum": NcclRedOp.SUM,
        "product": NcclRedOp.PROD,
        "max": NcclRedOp.MAX,
        "min": NcclRedOp.MIN,
        "avg": NcclRedOp.AVG,
    }
    found = mapping.get(str(op))
    if found is None:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(mapping)}")
    if version < found.min_version:
        raise ValueError(
            f"ReduceOp {op} needs NCCL >= {_fmt(found.min_version)}, this library is "
            f"{_fmt(version)}; load a newer one ({INSTALL_HINT})"
        )
    return found


# -- the bound functions ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Fn:
    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    optional: bool = False  # absent from older NCCL releases


_P = ctypes.POINTER
_size_t = ctypes.c_size_t
_int = ctypes.c_int
# One entry per C function, under its prototype from nccl.h. Kept unformatted so that each
# binding stays on one line beside its prototype.
# fmt: off
_FUNCTIONS: tuple[_Fn, ...] = (
    # ncclResult_t ncclGetVersion(int* version);
    _Fn("ncclGetVersion", ncclResult_t, (_P(_int),)),
    # const char* ncclGetErrorString(ncclResult_t result);
    _Fn("ncclGetErrorString", ctypes.c_char_p, (ncclResult_t,)),
    # const char* ncclGetLastError(ncclComm_t comm);  -- NCCL >= 2.13
    _Fn("ncclGetLastError", ctypes.c_char_p, (ncclComm_t,), optional=True),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    _Fn("ncclGetUniqueId", ncclResult_t, (_P(NcclUniqueId),)),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    _Fn("ncclCommInitRank", ncclResult_t, (_P(ncclComm_t), _int, NcclUniqueId, _int)),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    _Fn("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    _Fn("ncclCommAbort", ncclResult_t, (ncclComm_t,)),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclAllReduce", ncclResult_t, (buffer_t, buffer_t, _size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
    #     ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclAllGather", ncclResult_t, (buffer_t, buffer_t, _size_t, ncclDataType_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    #     ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclReduceScatter", ncclResult_t, (buffer_t, buffer_t, _size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclBroadcast", ncclResult_t, (buffer_t, buffer_t, _size_t, ncclDataType_t, _int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
    #     ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclReduce", ncclResult_t, (buffer_t, buffer_t, _size_t, ncclDataType_t, ncclRedOp_t, _int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
    #     int peer, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclSend", ncclResult_t, (buffer_t, _size_t, ncclDataType_t, _int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype,
    #     int peer, ncclComm_t comm, cudaStream_t stream);
    _Fn("ncclRecv", ncclResult_t, (buffer_t, _size_t, ncclDataType_t, _int, ncclComm_t, cudaStream_t)),
    # ncclResult_t ncclGroupStart();
    _Fn("ncclGroupStart", ncclResult_t, ()),
    # ncclResult_t ncclGroupEnd();
    _Fn("ncclGroupEnd", ncclResult_t, ()),
)
# fmt: on


class NcclError(RuntimeError):
    """An NCCL call returned an error code.

    Attributes:
        result: the ``NcclResult`` (or the raw int when NCCL returned an unknown code).
        error_string: ``ncclGetErrorString(result)``.
        last_error: ``ncclGetLastError``'s detail ("" when NCCL has none or is older than 2.13).
    """

    def __init__(
        self, result: int, error_string: str, last_error: str = "", call: str = ""
    ) -> None:
        try:
            self.result: int = NcclResult(result)
        except ValueError:
            self.result = result
        self.error_string = error_string
        self.last_error = last_error
        where = f"{call}: " if call else ""
        detail = f" ({last_error})" if last_error and last_error not in error_string else ""
        name = self.result.name if isinstance(self.result, NcclResult) else "unknown result"
        super().__init__(f"{where}NCCL error {int(result)} [{name}]: {error_string}{detail}")


class NcclLibraryError(BackendUnavailableError):
    """No usable libnccl could be loaded; the message lists every candidate tried and the fix."""


@dataclass(frozen=True, slots=True)
class LoadAttempt:
    """One candidate library: where it came from, its path, and why it was not used."""

    source: str
    path: str
    error: str


class NcclLibrary:
    """A loaded libnccl with every function of the table bound and checked.

    Methods mirror the C API one to one, taking Python ints for pointers, communicators and
    streams; every one that returns ``ncclResult_t`` raises ``NcclError`` on failure.

    Attributes:
        path: the file (or soname) that was loaded.
        source: why this one: ``"argument"``, ``ENV_VAR``, ``"torch"``, ``"nvidia-nccl wheel"`` or
            ``"system"``.
        attempts: the candidates passed over before it, each with its error.
        version: ``(major, minor, patch)``.
    """

    def __init__(
        self, path: str, source: str = "argument", attempts: Sequence[LoadAttempt] = ()
    ) -> None:
        self.path = path
        self.source = source
        self.attempts = tuple(attempts)
        self._cdll = ctypes.CDLL(path)  # OSError when it cannot be opened
        self._fn: dict[str, Any] = {}
        for spec in _FUNCTIONS:
            try:
                fn = getattr(self._cdll, spec.name)
            except AttributeError:
                if spec.optional:
                    continue
                raise OSError(
                    f"{path} has no symbol {spec.name}; it is not a NCCL 2 library"
                ) from None
            fn.restype = spec.restype
            fn.argtypes = list(spec.argtypes)
            self._fn[spec.name] = fn
        self.version = self.get_version()

    def __repr__(self) -> str:
        return f"NcclLibrary({self.path!r}, source={self.source!r}, version={self.version_string})"

    @property
    def version_string(self) -> str:
        return _fmt(self.version)

    # -- errors ----------------------------------------------------------------------------
    def error_string(self, result: int) -> str:
        raw = self._fn["ncclGetErrorString"](result)
        return raw.decode(errors="replace") if raw else ""

    def last_error(self, comm: int | None = None) -> str:
        fn = self._fn.get("ncclGetLastError")
        raw = fn(comm) if fn is not None else None
        return raw.decode(errors="replace") if raw else ""

    def check(self, result: int, call: str = "", comm: int | None = None) -> None:
        """Raise ``NcclError`` for a non-success code, with NCCL's own strings."""
        if result != NcclResult.SUCCESS:
            raise NcclError(result, self.error_string(result), self.last_error(comm), call)

    # -- set-up ----------------------------------------------------------------------------
    def get_version(self) -> tuple[int, int, int]:
        code = ctypes.c_int()
        self.check(self._fn["ncclGetVersion"](ctypes.byref(code)), "ncclGetVersion")
        return decode_version(code.value)

    def get_unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self._fn["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return uid.to_bytes()

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """A communicator handle for ``rank`` of ``nranks``; blocks until every rank joins.

        The CUDA device current in this thread is the communicator's device.
        """
        comm = ncclComm_t()
        uid = NcclUniqueId.from_bytes(unique_id)
        rc = self._fn["ncclCommInitRank"](ctypes.byref(comm), nranks, uid, rank)
        self.check(rc, "ncclCommInitRank")
        assert comm.value is not None, "ncclCommInitRank succeeded without a communicator"
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self.check(self._fn["ncclCommDestroy"](comm), "ncclCommDestroy")

    def comm_abort(self, comm: int) -> None:
        self.check(self._fn["ncclCommAbort"](comm), "ncclCommAbort")

    # -- operations (enqueued on ``stream``; nothing here synchronizes) ----------------------
    def all_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int
    ) -> None:
        rc = self._fn["ncclAllReduce"](send, recv, count, dtype, op, comm, stream)
        self.check(rc, "ncclAllReduce", comm)

    def all_gather(
        self, send: int, recv: int, send_count: int, dtype: int, comm: int, stream: int
    ) -> None:
        rc = self._fn["ncclAllGather"](send, recv, send_count, dtype, comm, stream)
        self.check(rc, "ncclAllGather", comm)

    def reduce_scatter(
        self, send: int, recv: int, recv_count: int, dtype: int, op: int, comm: int, stream: int
    ) -> None:
        rc = self._fn["ncclReduceScatter"](send, recv, recv_count, dtype, op, comm, stream)
        self.check(rc, "ncclReduceScatter", comm)

    def broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, comm: int, stream: int
    ) -> None:
        rc = self._fn["ncclBroadcast"](send, recv, count, dtype, root, comm, stream)
        self.check(rc, "ncclBroadcast", comm)

    def reduce(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: int,
        op: int,
        root: int,
        comm: int,
        stream: int,
    ) -> None:
        rc = self._fn["ncclReduce"](send, recv, count, dtype, op, root, comm, stream)
        self.check(rc, "ncclReduce", comm)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self.check(self._fn["ncclSend"](buf, count, dtype, peer, comm, stream), "ncclSend", comm)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> None:
        self.check(self._fn["ncclRecv"](buf, count, dtype, peer, comm, stream), "ncclRecv", comm)

    def group_start(self) -> None:
        self.check(self._fn["ncclGroupStart"](), "ncclGroupStart")

    def group_end(self) -> None:
        self.check(self._fn["ncclGroupEnd"](), "ncclGroupEnd")


def decode_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as ``(major, minor, patch)`` (its encoding changed in 2.9)."""
    if code >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return (code // 10000, code // 100 % 100, code % 100)
    return (code // 1000, code // 100 % 10, code % 100)


def load_nccl(path: str | None = None, *, environ: dict[str, str] | None = None) -> NcclLibrary:
    """Load libnccl from the first candidate that works (see the module docstring for the order).

    Args:
        path: an explicit file; when given, nothing else is tried.
        environ: the environment to read ``VLLM_DIST_NCCL_SO_PATH`` from (default ``os.environ``).

    Raises:
        NcclLibraryError: nothing loaded; the message lists each candidate with its error and
            says how to install NCCL or point at one.
    """
    env = os.environ if environ is None else environ
    explicit = [("argument", path)] if path else []
    if not explicit and env.get(ENV_VAR):
        explicit = [(ENV_VAR, env[ENV_VAR])]
    if explicit:
        source, candidate = explicit[0]
        try:
            return NcclLibrary(candidate, source)
        except OSError as exc:
            if source == "argument":
                what, fix = "the path given", "pass the path of a libnccl.so.2 file, or pass none"
            else:
                what, fix = (
                    f"{ENV_VAR}={candidate!r}",
                    f"point {ENV_VAR} at a libnccl.so.2, or unset it",
                )
            raise NcclLibraryError(
                f"cannot load libnccl from {what}: {exc}. Fix: {fix} to search torch, the "
                "nvidia-nccl wheels and the system"
            ) from exc
    attempts: list[LoadAttempt] = []
    for source, candidate in _auto_candidates():
        try:
            return NcclLibrary(candidate, source, attempts)
        except OSError as exc:
            attempts.append(LoadAttempt(source, candidate, str(exc)))
    tried = "; ".join(f"{a.source} {a.path}: {a.error}" for a in attempts)
    raise NcclLibraryError(f"no libnccl could be loaded (tried {tried}); {INSTALL_HINT}")


def _auto_candidates() -> Iterator[tuple[str, str]]:
    for directory in _package_dirs("torch"):
        for found in sorted(glob.glob(os.path.join(directory, "lib", "libnccl.so*"))):
            yield "torch", found
    for directory in _package_dirs("nvidia"):
        for sub in ("nccl", "cu13", "cu12"):
            found = os.path.join(directory, sub, "lib", SONAME)
            if os.path.exists(found):
                yield "nvidia-nccl wheel", found
    yield "system", SONAME


def _package_dirs(package: str) -> list[str]:
    """Where ``package`` would import from, without importing it (``nvidia`` is a namespace)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def _fmt(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))
