"""Correctness cases that peers' test suites catch, one or more tests per case.

By-value pickling of ``trust_remote_code`` classes on a first launch, tasks that exit with code 0,
the router's ownerless names, ``view(dtype)`` loaders, pre-release versions, layer stacks of
vision-language models, and op names of a lying ``str`` subclass. Integer AVG and refused
reductions are in the conformance suite (vllm_dist/testing/conformance.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    DistributedTask,
    LaunchError,
    MPLauncher,
)
from vllm_dist.tasks.weight_transfer import (
    ConsumerSpec,
    RdtRouter,
    StateDictSource,
    WeightSource,
    WeightTransferTask,
    layerwise_groups,
    ops,
)
from vllm_dist.tasks.weight_transfer.ops import (
    BakeError,
    UnsafeOpError,
    bake,
    check_chain,
    replay,
)
from vllm_dist.versions import RayRdtUnavailableError, check_ray_rdt_version

REPO = Path(__file__).resolve().parent.parent

# -- trust_remote_code classes travel by value on the first launch -------------------------------
_CONFIGURATION_BAR = """
from transformers import PretrainedConfig


class BarConfig(PretrainedConfig):
    model_type = "bar"

    def __init__(self, width=4, **kwargs):
        self.width = width
        super().__init__(**kwargs)

    def tripled(self):
        return 3 * self.width
"""

# A fresh interpreter: loads the config (transformers imports only the leaf module of
# transformers_modules), hides the module cache from the workers (``clean``: deletes it, as a
# cleaned cache on the head node), and launches once. Prints the results as JSON.
_FIRST_LAUNCH = """
import importlib.util, json, os, shutil, sys, tempfile

import transformers
from vllm_dist import DistributedTask, LaunchError, MPLauncher


class UseConfig(DistributedTask):
    def run(self, *, config):
        return {
            "importable": importlib.util.find_spec("transformers_modules") is not None,
            "module": type(config).__module__,
            # a class pickled by reference imports its module on unpickling; by value it does not
            "module_loaded": type(config).__module__ in sys.modules,
            "tripled": config.tripled(),
        }


def main(kind, model_dir, modules_cache, worker_cache, clean):
    config = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "transformers_modules")
    if clean == "clean":
        shutil.rmtree(modules_cache)
        # spawned workers inherit sys.path: without the cache they are a node that never had it
        sys.path[:] = [p for p in sys.path if os.path.abspath(p) != os.path.abspath(modules_cache)]
    env = {"HF_MODULES_CACHE": worker_cache, "HF_HUB_OFFLINE": "1"}
    if kind == "mp":
        launcher = MPLauncher(2, timeout=120, env=env)
    else:
        import ray
        from vllm_dist import RayLauncher

        temp = tempfile.mkdtemp(prefix="ray")
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp,
                 _node_ip_address="127.0.0.1")
        launcher = RayLauncher(2, timeout=120, runtime_env={"env_vars": env})
    try:
        results = launcher.launch(task_type=UseConfig, config=config)
        out = {"ok": True, "results": results}
    except LaunchError as exc:
        out = {"ok": False, "error": str(exc)[-2000:]}
    finally:
        if kind == "ray":
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
    out["loaded"] = loaded
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
"""


def _first_launch(kind: str, tmp_path: Path, clean: str) -> dict[str, Any]:
    pytest.importorskip("transformers")
    model_dir = tmp_path / "bar_model"
    model_dir.mkdir()
    (model_dir / "configuration_bar.py").write_text(_CONFIGURATION_BAR)
    config = {
        "model_type": "bar",
        "width": 5,
        "auto_map": {"AutoConfig": "configuration_bar.BarConfig"},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    script = tmp_path / "first_launch.py"
    script.write_text(_FIRST_LAUNCH)
    modules_cache, worker_cache = tmp_path / "hf_modules", tmp_path / "worker_hf_modules"
    worker_cache.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(modules_cache),
        "HF_HUB_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
    }
    args = [kind, str(model_dir), str(modules_cache), str(worker_cache), clean]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    # the situation the issue describes: only the leaf module, never the package, was imported
    assert "transformers_modules" not in out["loaded"], out["loaded"]
    assert any(m.endswith(".configuration_bar") for m in out["loaded"]), out["loaded"]
    return out


def _assert_ran_by_value(out: dict[str, Any], clean: str) -> None:
    assert out["ok"], out.get("error")
    for r in out["results"]:
        assert r["module_loaded"] is False, "the config's class was pickled by reference"
        if clean == "clean":
            assert r["importable"] is False, "the worker must not have transformers_modules"
        assert r["module"].startswith("transformers_modules.")
        assert r["tripled"] == 15


@pytest.mark.parametrize("clean", ["kept_cache", "clean"])
@distributed_test(timeout=300)
def test_remote_code_config_by_value_on_first_mp_launch(tmp_path: Path, clean: str) -> None:
    _assert_ran_by_value(_first_launch("mp", tmp_path, clean), clean)


@pytest.mark.ray
@pytest.mark.parametrize("clean", ["kept_cache", "clean"])
@distributed_test(timeout=300)
def test_remote_code_config_by_value_on_first_ray_launch(tmp_path: Path, clean: str) -> None:
    pytest.importorskip("ray")
    _assert_ran_by_value(_first_launch("ray", tmp_path, clean), clean)


def _leaf_only_modules(package: str) -> list[str]:
    """Put ``package.repo.hash.configuration_x`` into ``sys.modules`` without its parents, as
    transformers 5 leaves it; returns the names of what is now loaded under ``package``."""
    leaf = types.ModuleType(f"{package}.repo.0123abcd.configuration_x")
    exec("class XConfig:\n    width = 3\n", leaf.__dict__)
    sys.modules[leaf.__name__] = leaf
    return [leaf.__name__]


@pytest.mark.forked  # changes sys.modules and the picklers' registries
def test_prepare_registers_leaf_modules_with_both_picklers() -> None:
    ray_pickle = pytest.importorskip("ray.cloudpickle")
    import cloudpickle

    from vllm_dist import serialization

    for name in [n for n in sys.modules if n.split(".")[0] == "transformers_modules"]:
        del sys.modules[name]  # forked: the session's own modules are untouched
    (leaf,) = _leaf_only_modules("transformers_modules")
    serialization.prepare()
    for pickler in (cloudpickle, ray_pickle):
        assert leaf in pickler.list_registry_pickle_by_value(), pickler.__name__
    config = sys.modules[leaf].XConfig()
    data = serialization.dumps(config)
    del sys.modules[leaf]  # a process without the module reads it all the same
    assert serialization.loads(data).width == 3


@pytest.mark.forked
def test_register_by_value_takes_a_package_whose_leaf_alone_is_loaded() -> None:
    import cloudpickle

    from vllm_dist.serialization import register_by_value

    (leaf,) = _leaf_only_modules("vd_dynamic_pkg")
    register_by_value("vd_dynamic_pkg")  # the package itself was never imported
    assert leaf in cloudpickle.list_registry_pickle_by_value()


# -- exit code 0 is a success ----------------------------------------------------------------------
class ExitTask(DistributedTask):
    """Rank 0 ends with ``sys.exit(code)``; the others return their rank."""

    def run(self, *, code: Any = 0, hard: bool = False) -> int:
        if self.worker_info.rank == 0:
            sys.stdout.flush()
            if hard:
                os._exit(code)
            sys.exit(code)
        return self.worker_info.rank


@distributed_test(timeout=120)
def test_sys_exit_zero_is_a_success_without_a_result(make_launcher: Any) -> None:
    launcher = make_launcher(2)
    assert launcher.launch(task_type=ExitTask, code=0) == [None, 1]
    assert launcher.launch(task_type=ExitTask, code=None) == [None, 1]


@distributed_test(timeout=120)
def test_sys_exit_nonzero_is_still_a_failure(make_launcher: Any) -> None:
    with pytest.raises(LaunchError) as err:
        make_launcher(2).launch(task_type=ExitTask, code=3)
    assert 0 in err.value.ranks


@distributed_test(timeout=120)
def test_os_exit_zero_is_a_success_under_mp() -> None:
    from vllm_dist import MPLauncher

    assert MPLauncher(2, timeout=60).launch(task_type=ExitTask, code=0, hard=True) == [None, 1]


# -- the router ------------------------------------------------------------------------------------
def test_producer_for_a_name_without_owner_raises_validates_value_error() -> None:
    router = RdtRouter(2, 1, owner_sets=[[0, 1], []], name_owner_class=[0, 1], names=["a", "b"])
    with pytest.raises(ValueError) as validated:
        router.validate()
    with pytest.raises(ValueError) as routed:
        router.producer_for(0, "b")
    assert str(routed.value) == str(validated.value)
    assert "owner set 1 is empty" in str(routed.value)
    assert router.producer_for(0, "a") == 0


def test_producer_for_with_no_producers_raises_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        RdtRouter(0, 1).producer_for(0, "x")


# -- view(dtype) loaders ---------------------------------------------------------------------------
def _as_bytes_loader(dest: Any, src: Any) -> None:
    dest.copy_(src.view(torch.uint8))


def test_view_dtype_loader_bakes_with_its_result_dtype() -> None:
    dest = torch.empty(4, 16, dtype=torch.uint8)
    (copy,) = bake(_as_bytes_loader, (4, 8), torch.bfloat16, dest, "w")
    assert copy.src_chain == (("view", (torch.uint8,)),)
    assert (copy.shape, copy.dtype) == ((4, 16), torch.uint8)
    assert ops.chain_dtype(torch.bfloat16, copy.src_chain) is torch.uint8
    assert ops.chain_dtype(torch.bfloat16, (("narrow", (0, 0, 2)),)) is torch.bfloat16
    weight = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8)
    out = replay(weight, check_chain(copy.src_chain))
    assert out.dtype is torch.uint8 and torch.equal(out, weight.view(torch.uint8))


def test_view_dtype_keyword_and_fp8() -> None:
    dest = torch.empty(2, 6, dtype=torch.float8_e4m3fn)
    copies = bake(
        lambda d, s: d.copy_(s.view(dtype=torch.float8_e4m3fn)), (2, 6), torch.uint8, dest
    )
    assert copies[0].src_chain == (("view", (torch.float8_e4m3fn,)),)
    assert copies[0].dtype is torch.float8_e4m3fn


def test_view_dtype_into_another_dtype_is_refused_at_bake() -> None:
    dest = torch.empty(4, 8, dtype=torch.int8)
    with pytest.raises(BakeError, match=r"torch\.uint8.*torch\.int8"):
        bake(lambda d, s: d.copy_(s.view(torch.uint8)), (4, 8), torch.uint8, dest, "w")


def test_a_casting_copy_without_view_dtype_still_bakes() -> None:
    dest = torch.empty(4, 8, dtype=torch.float32)
    (copy,) = bake(lambda d, s: d.copy_(s), (4, 8), torch.bfloat16, dest)
    assert copy.dtype is torch.bfloat16


@pytest.mark.parametrize(
    "chain",
    [
        (("view", ("torch.uint8",)),),  # a string is not a dtype
        (("view", (torch.uint8, 3)),),  # a dtype only as the one argument
        (("view", ((torch.uint8,),)),),
        (("reshape", (torch.uint8,)),),  # only view reinterprets
        (("narrow", (torch.uint8, 0, 1)),),
    ],
)
def test_check_chain_takes_a_dtype_only_as_views_one_real_torch_dtype(chain: Any) -> None:
    with pytest.raises(UnsafeOpError):
        check_chain(chain)


def test_check_chain_accepts_a_real_dtype_view() -> None:
    chain = (("narrow", (0, 0, 2)), ("view", (torch.float8_e5m2,)))
    assert check_chain(chain) is chain


# -- versions --------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["2.56.0rc1", "2.56.0.dev0", "2.56.0a1", "2.55.9", "2.9.0"])
def test_rdt_version_refuses_older_and_pre_releases_of_the_floor(version: str) -> None:
    with pytest.raises(RayRdtUnavailableError, match="too old"):
        check_ray_rdt_version(version)


@pytest.mark.parametrize("version", ["2.56.0", "2.56.1", "2.60.0", "2.57.0rc1", "3.0.0.dev0"])
def test_rdt_version_accepts_the_floor_and_newer(version: str) -> None:
    assert check_ray_rdt_version(version) == version


def test_rdt_version_refuses_a_version_that_is_not_pep_440() -> None:
    with pytest.raises(RayRdtUnavailableError, match="PEP 440"):
        check_ray_rdt_version("not-a-version")


# -- layer stacks ----------------------------------------------------------------------------------
def test_layerwise_groups_one_group_per_layer_per_stack() -> None:
    names = [
        "visual.patch_embed.proj.weight",
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.1.attn.qkv.weight",
        "visual.blocks.0.mlp.fc1.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.1.mlp.down_proj.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.layers.0.mlp.experts.3.w1",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ]
    assert layerwise_groups(names) == [
        ["visual.patch_embed.proj.weight"],
        ["visual.blocks.0.attn.qkv.weight", "visual.blocks.0.mlp.fc1.weight"],
        ["visual.blocks.1.attn.qkv.weight"],
        [
            "model.language_model.layers.0.self_attn.q_proj.weight",
            "model.language_model.layers.0.mlp.experts.3.w1",
        ],
        ["model.language_model.layers.1.mlp.down_proj.weight"],
        [
            "model.language_model.embed_tokens.weight",
            "model.language_model.norm.weight",
            "lm_head.weight",
        ],
    ]


# -- op names are exactly str ----------------------------------------------------------------------
class _LyingStr(str):
    """Hashes and compares like an allowed op, but getattr() sees its real text."""

    def __hash__(self) -> int:
        return hash("narrow")

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


def test_check_chain_refuses_a_lying_str_subclass_as_op_name() -> None:
    op = _LyingStr("fill_")
    assert op in {"narrow"}  # the lie works on a plain membership test
    weight = torch.zeros(4)
    with pytest.raises(UnsafeOpError, match="not allowed"):
        check_chain(((op, (1.0,)),))
    with pytest.raises(UnsafeOpError):
        replay(weight, ((op, (1,)),))
    assert torch.equal(weight, torch.zeros(4)), "fill_ ran on the producer's tensor"


class _TupleOf(tuple):  # type: ignore[type-arg]
    pass


def test_check_chain_refuses_tuple_subclasses() -> None:
    with pytest.raises(UnsafeOpError):
        check_chain(_TupleOf((("narrow", (0, 0, 1)),)))
    with pytest.raises(UnsafeOpError):
        check_chain((_TupleOf(("narrow", (0, 0, 1))),))
    with pytest.raises(UnsafeOpError):
        check_chain((("narrow", _TupleOf((0, 0, 1))),))


# -- a view(dtype) loader end to end: the consumer's parameter holds the weight's bytes ----------


def _reinterpret(dest: torch.Tensor, src: torch.Tensor) -> None:
    dest.copy_(src.view(torch.int16))  # packed storage, as fp8 and quantized engines keep it


class ViewDtypeTask(WeightTransferTask):
    """One producer of bf16 weights; one consumer that keeps their bytes as int16."""

    def make_source(self, producer_idx: int, num_producers: int, **_: Any) -> WeightSource:
        g = torch.Generator().manual_seed(7)
        self.weights = {
            f"layers.{i}.w": torch.randn(64, 32, generator=g).bfloat16() for i in range(3)
        }
        return StateDictSource(self.weights)

    def before_producer_sync(self, step: int, source: WeightSource, **_: Any) -> None:
        for w in self.weights.values():
            w.add_(1.0)

    def make_consumer(self, consumer_idx: int, num_consumers: int, **_: Any) -> ConsumerSpec:
        params = {f"layers.{i}.w": torch.zeros(64, 32, dtype=torch.int16) for i in range(3)}
        return ConsumerSpec(params=params, route=lambda name: [(name, _reinterpret)])

    def after_consumer_sync(self, step: int, spec: ConsumerSpec, **_: Any) -> Any:
        g = torch.Generator().manual_seed(7)
        want = [torch.randn(64, 32, generator=g).bfloat16() for _ in range(3)]
        for w in want:
            for _ in range(step + 1):
                w.add_(1.0)  # as the producer did, in bf16 rounding
        got = [spec.params[f"layers.{i}.w"].view(torch.bfloat16) for i in range(3)]
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@distributed_test(timeout=300)
@pytest.mark.parametrize("comm", ["torch_distributed", "nixl_rdt"])
def test_view_dtype_loader_moves_the_weights_bytes_end_to_end(comm: str) -> None:
    if comm == "nixl_rdt":
        pytest.importorskip("nixl")
    results = MPLauncher(2, timeout=240).launch(
        task_type=ViewDtypeTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType(comm),
        num_producers=1,
        num_consumers=1,
        syncs=2,
    )
    assert results[1]["outputs"] == [True, True], results[1]
