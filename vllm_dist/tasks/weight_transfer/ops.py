"""The op chain: how a consumer's own loader becomes a list of pure view ops a producer replays.

At set-up the consumer runs its loader once on *fake* tensors (``bake``). A fake wraps a meta
tensor, so shapes and bounds are checked for real, and records every allowed view op applied to
it; ``dest.copy_(src)`` records one transfer item (the source chain, the destination chain and
the shape). Anything else a loader does — ``.to``, arithmetic, ``.item()``, ``torch.cat`` — needs
real data or allocates, and fails at set-up with a ``BakeError`` instead of mid-transfer.

The producer replays a chain as ``getattr(tensor, op)(*args)`` and refuses any op outside
``ALLOWED_OPS`` and any argument that is not plain data (ints, slices, ``None``, ``...``, and a
real ``torch.dtype`` as the one argument of ``view``, which reinterprets bytes: fp8, packed
weights), so a spoofed consumer cannot make a producer call an arbitrary method. Types are
compared exactly, never with ``isinstance``: a ``str`` subclass can lie about its hash and
equality. Keyword arguments are turned into positional ones at bake time, so a chain is always
``(op, args)`` pairs. A chain's result dtype is tracked (``chain_dtype``): a copy that
reinterprets bytes must land in a destination of the same dtype, checked at bake.

Rejected alternative: letting the producer run the consumer's loader (a pickled function) — that
executes foreign code on trainer ranks and cannot be checked before the first sync.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ALLOWED_OPS = frozenset(
    {
        "narrow",
        "view",
        "reshape",
        "__getitem__",
        "unsqueeze",
        "squeeze",
        "transpose",
        "t",
        "permute",
        "flatten",
        "contiguous",
        "chunk",
        "unbind",
    }
)

Op = tuple[str, tuple[Any, ...]]
OpChain = tuple[Op, ...]
Loader = Callable[[Any, Any], None]
"""``loader(dest_param, full_src_weight)``: copies the consumer's part of the weight into dest."""

# parameter names of the allowed ops, to turn keyword arguments into positional ones
_SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "narrow": (("dim", None), ("start", None), ("length", None)),
    "unsqueeze": (("dim", None),),
    "squeeze": (("dim", None),),
    "transpose": (("dim0", None), ("dim1", None)),
    "flatten": (("start_dim", 0), ("end_dim", -1)),
    "chunk": (("chunks", None), ("dim", 0)),
    "unbind": (("dim", 0),),
}
_REQUIRED = object()


class BakeError(ValueError):
    """A consumer loader did something that is not a pure view of the source weight."""


class UnsafeOpError(ValueError):
    """A producer was asked to replay an op chain outside ``ALLOWED_OPS`` (or with odd args)."""


@dataclass(frozen=True, slots=True)
class Copy:
    """One ``dest.copy_(src)`` a loader made: what to take from the source, where it lands."""

    src_chain: OpChain
    dest_chain: OpChain
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None  # what ``src_chain`` produces; None: the weight's own


def bake(
    loader: Loader,
    src_shape: Sequence[int],
    src_dtype: torch.dtype,
    dest: torch.Tensor,
    name: str = "?",
    meta_cache: dict[Any, torch.Tensor] | None = None,
) -> list[Copy]:
    """Run ``loader(dest, src)`` on fakes of ``dest`` and of a ``src_shape`` weight.

    Returns the copies it made (often one; fused loaders may make several). ``meta_cache``
    (a dict the caller keeps) reuses meta tensors across calls: baking 100,000 weights of a few
    shapes then allocates a few meta tensors instead of 200,000.

    Raises:
        BakeError: the loader used an op that is not an allowed view, called something that needs
            real data, copied tensors of different shapes, or reinterpreted bytes
            (``view(dtype)``) into a destination view of another dtype. The message names the
            weight.
    """
    tape: list[Copy] = []
    cache = {} if meta_cache is None else meta_cache
    src = _Fake(_meta(cache, tuple(src_shape), src_dtype), (), "src", tape)
    dst = _Fake(_meta(cache, tuple(dest.shape), dest.dtype), (), "dest", tape)
    try:
        loader(dst, src)
    except BakeError as exc:
        raise BakeError(f"weight {name!r}: {exc}") from None
    except Exception as exc:  # a shape or bounds error from the meta tensors
        raise BakeError(
            f"weight {name!r}: the loader failed on fake tensors (source shape "
            f"{tuple(src_shape)}, destination shape {tuple(dest.shape)}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return tape


_PLAIN = frozenset({int, float, str, bool, bytes, type(None), torch.dtype, types.FunctionType})


def loader_key(loader: Any) -> Hashable | None:
    """What makes two loaders bake the same way, or None when that cannot be told.

    Loaders are pure functions of their code, their closure values and the shapes (they see
    only fakes), so two closures of one code object over equal plain values (ints, strings,
    dtypes, other functions) record the same chain for the same shapes; 100,000 expert weights
    loaded by a handful of such closures then bake a handful of times. Anything else (a bound
    method, a closure over an object) gets None and is baked per name.
    """
    if type(loader) is functools.partial:
        inner = loader_key(loader.func)
        parts = (*loader.args, *sorted(loader.keywords.items()))
        if inner is None or not all(_plain(p) for p in parts):
            return None
        return ("partial", inner, parts)
    if type(loader) is not types.FunctionType:
        return None
    closure = loader.__closure__
    cells = tuple([c.cell_contents for c in closure]) if closure else ()
    for v in cells:
        if type(v) not in _PLAIN and not _plain(v):
            return None
    if loader.__defaults__ is None and loader.__kwdefaults__ is None:
        return (loader.__code__, cells)
    defaults = (loader.__defaults__ or (), tuple(sorted((loader.__kwdefaults__ or {}).items())))
    if not _plain(defaults):
        return None
    return (loader.__code__, cells, defaults)


def _plain(value: Any) -> bool:
    if type(value) in _PLAIN:
        return True
    if type(value) is tuple:
        return all(_plain(v) for v in value)
    return False


def _meta(
    cache: dict[Any, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    t = cache.get((shape, dtype))
    if t is None:
        t = cache[(shape, dtype)] = torch.empty(shape, dtype=dtype, device="meta")
    return t


def replay(tensor: torch.Tensor, chain: OpChain) -> torch.Tensor:
    """Apply ``chain`` to ``tensor`` as ``getattr(t, op)(*args)``, refusing anything unsafe.

    Raises:
        UnsafeOpError: an op outside ``ALLOWED_OPS``, an argument that is not plain data, or a
            chain that does not end in a tensor.
    """
    out: Any = tensor
    for op, args in check_chain(chain):
        out = getattr(out, op)(*args)
    if not isinstance(out, torch.Tensor):
        raise UnsafeOpError(f"op chain {chain!r} ends in {type(out).__name__}, not a tensor")
    return out


_LAYOUT_OPS = frozenset({"t", "transpose", "permute", "contiguous"})


def split_for_wire(chain: OpChain) -> tuple[OpChain, OpChain]:
    """(prefix, suffix): the producer packs ``prefix``; the consumer applies ``suffix`` on unpack.

    The suffix is the trailing run of pure re-layout ops (``t``, ``transpose``, ``permute``,
    ``contiguous``). A transposing copy is the slowest pack there is (strided reads); leaving it
    to the consumer spreads it over the consumers instead of serialising it on the producer, and
    the bytes on the wire are the same size either way.
    """
    cut = len(chain)
    while cut and chain[cut - 1][0] in _LAYOUT_OPS:
        cut -= 1
    return chain[:cut], chain[cut:]


def check_chain(chain: Any) -> OpChain:
    """``chain`` if every op is allowed and every argument plain data, else ``UnsafeOpError``."""
    # exact types: a subclass of str or tuple can lie about equality, hashing or iteration
    if type(chain) is not tuple:
        raise UnsafeOpError(f"an op chain must be a tuple of (op, args), got {type(chain)}")
    for step in chain:
        if not (type(step) is tuple and len(step) == 2 and type(step[1]) is tuple):
            raise UnsafeOpError(f"op chain step {step!r} is not an (op, args) pair")
        op, args = step
        if type(op) is not str or op not in ALLOWED_OPS:
            raise UnsafeOpError(
                f"op {op!r} is not allowed in a weight-transfer op chain; producers replay only "
                f"pure views: {sorted(ALLOWED_OPS)}"
            )
        if op == "view" and len(args) == 1 and type(args[0]) is torch.dtype:
            continue  # view(dtype): reinterpret the bytes
        for arg in args:
            _check_arg(op, arg)
    return chain


def chain_dtype(dtype: torch.dtype, chain: OpChain) -> torch.dtype:
    """The dtype ``chain`` produces from a weight of ``dtype``: that of its last ``view(dtype)``."""
    for op, args in chain:
        if op == "view" and _is_dtype_args(args):
            dtype = args[0]
    return dtype


def _is_dtype_args(args: tuple[Any, ...]) -> bool:
    """``args`` is ``(dtype,)`` with a real ``torch.dtype`` (exact type, as everywhere here)."""
    return len(args) == 1 and type(args[0]) is torch.dtype


def _check_arg(op: str, arg: Any) -> None:
    if arg is None or arg is Ellipsis or (type(arg) is int):
        return
    if type(arg) is slice:
        for part in (arg.start, arg.stop, arg.step):
            if part is not None and type(part) is not int:
                raise UnsafeOpError(f"op {op!r}: slice bound {part!r} is not an int")
        return
    if type(arg) in (tuple, list, torch.Size):
        for a in arg:
            _check_arg(op, a)
        return
    raise UnsafeOpError(
        f"op {op!r}: argument {arg!r} of type {type(arg).__name__} is not plain data "
        "(ints, slices, None, ..., or a torch.dtype as the only argument of view)"
    )


def _positional(op: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    if not kwargs:
        return args
    if op == "view" and not args and set(kwargs) == {"dtype"}:
        return (kwargs["dtype"],)
    sig = _SIGNATURES.get(op)
    if sig is None:
        raise BakeError(f".{op}() with keyword arguments {sorted(kwargs)}; pass them positionally")
    out = list(args)
    left = dict(kwargs)
    for i, (pname, default) in enumerate(sig):
        if i < len(args):
            if pname in left:
                raise BakeError(f".{op}() got {pname!r} twice")
            continue
        if pname in left:
            out.append(left.pop(pname))
        elif left:  # a later parameter is given: fill this one with its default
            if default is None:
                raise BakeError(f".{op}() is missing its {pname!r} argument")
            out.append(default)
    if left:
        raise BakeError(f".{op}() got unexpected keyword arguments {sorted(left)}")
    return tuple(out)


_METADATA_ATTRS = frozenset({"shape", "dtype", "ndim", "device", "is_contiguous", "numel"})


class _Fake:
    """A stand-in for a weight or a destination parameter that records the views taken of it."""

    __slots__ = ("_meta", "_chain", "_side", "_tape")

    def __init__(self, meta: torch.Tensor, chain: OpChain, side: str, tape: list[Copy]) -> None:
        self._meta = meta
        self._chain = chain
        self._side = side
        self._tape = tape

    # -- metadata a loader may read ------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    @property
    def ndim(self) -> int:
        return self._meta.ndim

    @property
    def data(self) -> _Fake:
        return self

    def size(self, dim: int | None = None) -> Any:
        return self._meta.size() if dim is None else self._meta.size(dim)

    def dim(self) -> int:
        return self._meta.dim()

    def numel(self) -> int:
        return self._meta.numel()

    def element_size(self) -> int:
        return self._meta.element_size()

    # -- recorded views ------------------------------------------------------------------------
    def _apply(self, op: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        args = _positional(op, args, kwargs)
        try:
            check_chain(((op, args),))
        except UnsafeOpError as exc:
            raise BakeError(str(exc)) from None
        result = getattr(self._meta, op)(*args)
        chain = (*self._chain, (op, args))
        if isinstance(result, torch.Tensor):
            return _Fake(result, chain, self._side, self._tape)
        return tuple(  # chunk / unbind: pick each part by index, itself a replayable op
            _Fake(part, (*chain, ("__getitem__", (i,))), self._side, self._tape)
            for i, part in enumerate(result)
        )

    def __getattr__(self, name: str) -> Any:
        if name in ALLOWED_OPS:
            return lambda *args, **kwargs: self._apply(name, args, kwargs)
        raise BakeError(
            f"the loader called .{name} on the {self._side} tensor; only pure views are allowed "
            f"at weight-transfer set-up ({', '.join(sorted(ALLOWED_OPS))}, then dest.copy_(src)); "
            "ops that need real data or allocate (.to, arithmetic, .item(), ...) belong after "
            "the transfer"
        )

    def __getitem__(self, index: Any) -> _Fake:
        return self._apply("__getitem__", (index,), {})  # type: ignore[no-any-return]

    def __setitem__(self, index: Any, value: Any) -> None:
        if self._side != "dest":
            raise BakeError("the loader assigned into the source weight (__setitem__)")
        self[index].copy_(value)

    def copy_(self, src: Any, non_blocking: bool = False) -> _Fake:
        if self._side != "dest":
            raise BakeError("the loader called copy_ on the source weight; copy into dest")
        if not isinstance(src, _Fake) or src._side != "src":
            raise BakeError(
                f"dest.copy_() got {type(src).__name__}; a loader may only copy views of the "
                "source weight into the destination"
            )
        if src.shape != self.shape:
            raise BakeError(
                f"dest.copy_(src) with destination view shape {tuple(self.shape)} and source "
                f"view shape {tuple(src.shape)}; shapes must match exactly (no broadcasting)"
            )
        reinterprets = any(op == "view" and _is_dtype_args(a) for op, a in src._chain + self._chain)
        if reinterprets and src.dtype != self.dtype:
            raise BakeError(
                f"dest.copy_(src) reinterprets bytes (view(dtype)) but the source view is "
                f"{src.dtype} and the destination view {self.dtype}; a reinterpreted copy must "
                "land in a view of the same dtype"
            )
        self._tape.append(Copy(src._chain, self._chain, tuple(src.shape), src.dtype))
        return self

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in ALLOWED_OPS and args and isinstance(args[0], _Fake):
            return args[0]._apply(name, tuple(args[1:]), kwargs or {})
        raise BakeError(
            f"the loader called torch.{name} on a weight; only pure views are allowed at "
            f"weight-transfer set-up: {', '.join(sorted(ALLOWED_OPS))}"
        )

    def _refuse(self, *_: Any) -> Any:
        raise BakeError(
            f"the loader used arithmetic, a conversion or iteration on the {self._side} tensor; "
            "only pure views are allowed at weight-transfer set-up"
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __floordiv__ = __neg__ = __matmul__ = __pow__ = _refuse
    __float__ = __int__ = __bool__ = __index__ = __iter__ = __len__ = __array__ = _refuse
    __iadd__ = __imul__ = __isub__ = _refuse

    def __repr__(self) -> str:
        return f"FakeWeight({self._side}, shape={tuple(self.shape)}, chain={self._chain!r})"
