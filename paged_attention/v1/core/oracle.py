"""vLLM 0.33's own V1 core classes, loaded from its wheel's Python files: the oracle for ours.

Nothing of vLLM is part of this project. ``python tools/vllm_kernels.py fetch-core`` takes the
Python files of ``vllm/v1/core/`` and what they import out of the pinned wheel into a git-ignored
folder (``vllm-core/`` at the repository root, or the folder named by
``PAGED_ATTENTION_VLLM_CORE``). ``load()`` imports vLLM's ``KVCacheManager``, ``BlockPool``,
coordinators and ``Request`` from there on a CPU, without installing vLLM:

- the ``vllm`` package is registered bare, so its ``__init__`` (which sets torch up for CUDA and
  imports most of vLLM) never runs; ``VLLM_TARGET_DEVICE=cpu`` lets its configs pick a device;
- a named list of third-party packages that the core imports but never calls on these paths
  gets empty stand-ins while the import runs (only those that are not installed, and only then:
  they are taken out of ``sys.modules`` afterwards, so nothing else in the process sees them);
- vLLM subpackages the manager never uses (configs, multimodal, structured output, the engine's
  messages, ...) get stand-ins too, which keeps the import to under a hundred modules (about
  1.5 s); with ``scheduler=True`` they are imported for real (about 300 modules, 4-6 s). A
  scheduler load after a manager-only one in the same process imports ``vllm.v1`` again and
  hands out new classes; the earlier namespace keeps working with its own.

``msgspec`` must be the real package: ``SamplingParams`` is a ``msgspec.Struct``, and a
do-nothing stand-in silently keeps its defaults (``max_tokens=3`` stays 16). ``cbor2`` is real
where installed (``sha256_cbor`` needs it). ``available()`` says whether the files are there, and
why not.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

ENV_VAR = "PAGED_ATTENTION_VLLM_CORE"
VLLM_VERSION = "0.33.0"
DEFAULT_FOLDER = Path(__file__).resolve().parents[3] / "vllm-core"
FETCH_HINT = "python tools/vllm_kernels.py fetch-core --dest vllm-core"

# Files whose presence says the folder holds vLLM's core (relative to the folder).
MARKERS = (
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/request.py",
)

# Third-party packages imported on the core's paths but never called there. Each gets an empty
# stand-in while vLLM is imported, and only when it is not installed.
THIRD_PARTY_STAND_INS = (
    "cbor2", "aiohttp", "openai_harmony", "openai", "pybase64", "cachetools", "cloudpickle",
    "uvloop", "cpuinfo", "xgrammar", "fastapi", "partial_json_parser", "llguidance", "zmq",
)

# vLLM subpackages the managers import but never use: stand-ins keep the import small. The
# Scheduler needs the ones in SCHEDULER_NEEDS for real.
VLLM_STAND_INS = (
    "vllm.config", "vllm.v1.structured_output", "vllm.v1.engine", "vllm.multimodal",
    "vllm.pooling_params", "vllm.compilation", "vllm.v1.metrics.perf", "vllm.v1.spec_decode",
    "vllm.tokenizers",
)
SCHEDULER_NEEDS = VLLM_STAND_INS

# The classes the oracle hands out, by module.
_EXPORTS = {
    "vllm.v1.core.kv_cache_utils": (
        "KVCacheBlock", "FreeKVCacheBlockQueue", "BlockHash", "get_request_block_hasher",
        "init_none_hash", "hash_block_tokens", "make_block_hash_with_group_id",
    ),
    "vllm.v1.core.block_pool": ("BlockPool",),
    "vllm.v1.core.kv_cache_manager": ("KVCacheManager", "KVCacheBlocks"),
    "vllm.v1.core.kv_cache_coordinator": (
        "KVCacheCoordinator", "UnitaryKVCacheCoordinator", "HybridKVCacheCoordinator",
        "KVCacheCoordinatorNoPrefixCache", "get_kv_cache_coordinator",
    ),
    "vllm.v1.core.single_type_kv_cache_manager": (
        "FullAttentionManager", "SlidingWindowManager",
    ),
    "vllm.v1.kv_cache_interface": (
        "FullAttentionSpec", "SlidingWindowSpec", "KVCacheConfig", "KVCacheGroupSpec",
        "KVCacheTensor",
    ),
    "vllm.v1.request": ("Request", "RequestStatus"),
    "vllm.sampling_params": ("SamplingParams",),
    "vllm.utils.hashing": ("sha256", "sha256_cbor"),
}
_SCHEDULER_EXPORTS = {
    "vllm.v1.core.sched.scheduler": ("Scheduler",),
    "vllm.v1.core.sched.async_scheduler": ("AsyncScheduler",),
    "vllm.v1.core.sched.output": ("SchedulerOutput", "NewRequestData", "CachedRequestData"),
    "vllm.v1.outputs": ("ModelRunnerOutput",),
}


class OracleUnavailableError(RuntimeError):
    """vLLM's core files are not there (or cannot be imported); the message says why."""


def find_core() -> tuple[Path | None, str]:
    """``(folder holding vllm/v1/core, where it was found)`` or ``(None, why not)``."""
    named = os.environ.get(ENV_VAR)
    folder = Path(named) if named else DEFAULT_FOLDER
    where = f"{ENV_VAR}={named}" if named else str(DEFAULT_FOLDER)
    missing = [m for m in MARKERS if not (folder / m).is_file()]
    if missing:
        return None, (f"vLLM {VLLM_VERSION}'s core files are not in {where} "
                      f"({missing[0]} missing): run `{FETCH_HINT}`")
    return folder, where


def available() -> tuple[bool, str]:
    """Whether vLLM's core can be loaded here, and why (not)."""
    folder, why = find_core()
    if folder is None:
        return False, why
    if importlib.util.find_spec("msgspec") is None:
        return False, "the real msgspec package is needed (pip install -r requirements.txt)"
    return True, f"vLLM {VLLM_VERSION}'s core from {why}"


# --------------------------------------------------------------------------------------------
# Stand-ins
# --------------------------------------------------------------------------------------------

class _AnyMeta(type):
    """Metaclass of a stand-in: any attribute is another stand-in, and it can be subscripted,
    or-ed into a type hint, iterated (empty) and used as a base or a decorator."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # As a decorator (``@stand_in``), give the function or class back untouched.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return super().__call__(*args, **kwargs)

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls

    def __iter__(cls):
        return iter(())

    def __len__(cls) -> int:
        return 0


class _Any(metaclass=_AnyMeta):
    """A stand-in value: constructible with anything; never meant to be used for real."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # As a decorator (``@stand_in`` or ``@stand_in(...)``), give the function back.
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in(name)()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        # pydantic models in vLLM's configs name stand-in types in their fields: accept anything.
        from pydantic_core import core_schema
        return core_schema.any_schema()


def _stand_in(name: str) -> type:
    namespace = {"__qualname__": name, "__module__": "standin"}
    return _AnyMeta(name.rsplit(".", 1)[-1], (_Any,), namespace)


class _StandInModule(types.ModuleType):
    """A module whose every public attribute is a stand-in class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-in modules for the named packages (and anything under them)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def _covers(self, fullname: str) -> bool:
        return any(fullname == n or fullname.startswith(n + ".") for n in self.names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if not self._covers(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[bool, types.SimpleNamespace] = {}


def _vllm_stand_in(value: Any) -> bool:
    """Whether ``value`` stands in for something of vLLM's (not a third-party package's)."""
    if isinstance(value, _StandInModule):
        return value.__name__.startswith("vllm.")
    return isinstance(value, _AnyMeta) and value.__qualname__.startswith("vllm.")


def _drop_stand_ins() -> None:
    """Forget what a manager-only load stood in for, before importing the scheduler for real.

    vLLM cannot simply be imported twice (``vllm.utils.torch_utils`` registers types with torch
    once per process), so the modules that hold nothing stood in for stay: logging, platform and
    utility code. Everything under ``vllm.v1`` goes, and so does any module that holds a stand-in
    of vLLM's or is one; they are imported again, now against the real configs."""
    for name in [n for n in sys.modules if n.startswith("vllm.")]:
        module = sys.modules[name]
        if (name == "vllm.v1" or name.startswith("vllm.v1.") or _vllm_stand_in(module)
                or any(_vllm_stand_in(v) for v in vars(module).values())):
            del sys.modules[name]
    root = sys.modules["vllm"]
    for key, value in list(vars(root).items()):
        if _vllm_stand_in(value) or key == "v1":
            delattr(root, key)


def _import(folder: Path, scheduler: bool) -> types.SimpleNamespace:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    third_party = tuple(n for n in THIRD_PARTY_STAND_INS if importlib.util.find_spec(n) is None)
    vllm_stand_ins = tuple(n for n in VLLM_STAND_INS if not (scheduler and n in SCHEDULER_NEEDS))
    finder = _StandInFinder(third_party + vllm_stand_ins)
    if "vllm" in sys.modules:
        if not getattr(sys.modules["vllm"], "__vllm_core_oracle__", False):
            raise OracleUnavailableError("another vllm package is already imported in this process")
        _drop_stand_ins()
    else:
        package = types.ModuleType("vllm")
        package.__path__ = [str(folder / "vllm")]
        package.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
        package.__spec__.submodule_search_locations = package.__path__
        package.__file__ = None
        package.__vllm_core_oracle__ = True
        sys.modules["vllm"] = package
    sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    try:
        exports = dict(_EXPORTS, **(_SCHEDULER_EXPORTS if scheduler else {}))
        found: dict[str, Any] = {}
        for module_name, names in exports.items():
            module = importlib.import_module(module_name)
            for name in names:
                found[name] = getattr(module, name)
    except Exception as exc:
        raise OracleUnavailableError(f"vLLM's core did not import from {folder}: {exc!r}") from exc
    finally:
        sys.meta_path.remove(finder)
        # Third-party stand-ins leave with the import: vLLM's modules keep what they bound.
        for name in [n for n in set(sys.modules) - before if finder._covers(n)
                     and not n.startswith("vllm")]:
            del sys.modules[name]
    found["modules"] = sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm."))
    found["stand_ins"] = finder.names
    found["folder"] = folder
    return types.SimpleNamespace(**found)


def load(scheduler: bool = False) -> types.SimpleNamespace:
    """vLLM's classes (``KVCacheManager``, ``BlockPool``, ``Request``, ...; with ``scheduler``,
    ``Scheduler`` too) as attributes of a namespace. Loaded once per process; asking for the
    scheduler after a manager-only load imports vLLM again with the configs for real.

    Raises ``OracleUnavailableError`` (with the reason) where the files are not there.
    """
    with _lock:
        if scheduler in _loaded:
            return _loaded[scheduler]
        if not scheduler and True in _loaded:
            return _loaded[True]
        ok, why = available()
        if not ok:
            raise OracleUnavailableError(why)
        folder, _ = find_core()
        _loaded[scheduler] = _import(folder, scheduler)
        return _loaded[scheduler]


def smoke_test(o: types.SimpleNamespace) -> list[list[int]]:
    """Drive vLLM's manager through one small hybrid workload (full attention and a sliding
    window, block size 4): two requests sharing a prompt, freed. Returns the second request's
    block ids per group. ``fetch-core`` runs it so that modules imported at run time are kept."""
    import torch

    full = o.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    window = o.SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                 sliding_window=4)
    config = o.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        o.KVCacheGroupSpec(["full"], full), o.KVCacheGroupSpec(["window"], window)])
    manager = o.KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
                               hash_block_size=4, enable_caching=True, log_stats=True)
    o.init_none_hash(o.sha256_cbor)
    hasher = o.get_request_block_hasher(4, o.sha256_cbor)
    ids = []
    for i in range(2):
        request = o.Request(str(i), list(range(13)), o.SamplingParams(max_tokens=3), None,
                            block_hasher=hasher)
        blocks, hits, _ = manager.get_computed_blocks(request)
        manager.allocate_slots(request, 13 - hits, hits, blocks)
        ids.append([list(g) for g in manager.get_block_ids(str(i))])
    for i in range(2):
        manager.free(o.Request(str(i), list(range(13)), o.SamplingParams(max_tokens=3), None,
                               block_hasher=hasher))
    manager.make_prefix_cache_stats()
    if hasattr(o, "Scheduler"):
        # vLLM's Scheduler builds its configs, which import more of vLLM: run it too, so that
        # fetch-core keeps those modules.
        from paged_attention.v1.core.sched.oracle_config import smoke_test as scheduler_smoke_test
        scheduler_smoke_test(o)
    # What vLLM imported while running, too (fetch-core keeps the files listed here).
    o.modules = sorted(n for n in sys.modules if n == "vllm" or n.startswith("vllm."))
    return ids[1]
