"""Models built without weights: parameters stay on the meta device until a stage needs them.

A model built under :func:`deferred_init` (what ``AutoPipeStrategy.tensor_init_context`` and
``trainer.init_module()`` enter, so also ``configure_model``) has every parameter on the meta
device: tracing and cutting need only shapes, and each rank then materialises only its own
stage (:class:`Materializer`), on its device. Buffers are created for real: they are small and
usually *computed* at construction (causal masks, position ids), which the meta device would
lose. A model built under a plain ``torch.device("meta")`` works too when its initialisers
re-create its meta buffers (Hugging Face models do).

**Layout-independent initialisation.** A parameter is initialised by the model's own
initialisers, run for that parameter alone from a generator seeded with
``parameter_seed(seed, name)`` (SHA-256 of the seed and the parameter's first name in the
traced model's ``state_dict``): the owner module's ``reset_parameters()`` (the constructor's
initialisation of ``torch.nn`` layers), then, from the owner up to the root, every module
passed to the ``_init_weights(module)`` of its nearest ancestor that defines one (Hugging
Face's ``PreTrainedModel._init_weights``, applied to children before parents as its
``init_weights`` does; also the nanoGPT convention ``self.apply(self._init_weights)``). While
one parameter is initialised every other one is on the meta device, so the initialisers write
only that one and draw only its numbers: its value depends on the seed, its name, its shape
and the initialisers, never on which stage holds it or what else that stage holds. The same
seed therefore gives the same weights under any pipeline layout (on one device type: CPU and
CUDA generators differ). It does not reproduce the values an eager build draws from one
global stream.

**Inline initialisation.** A parameter made inline in ``__init__``
(``self.pos = nn.Parameter(torch.zeros(T, D))``, ``nn.Parameter(torch.randn(D) * 0.02)``) has
no initialiser to run; :func:`deferred_init` records the tensor operations that built its
data (:mod:`~lightning_autopipe.runtime.inline_init`, after torchdistx's ``deferred_init``)
and the parameter's materialisation replays them, from the parameter's own seed, before its
initialisers run (as construction ran before any ``apply(_init_weights)``): zeros stay zeros.
A parameter neither recorded nor written by an initialiser is an error naming it (or load a
checkpoint).

**From a checkpoint.** With a ``source`` (a mapping of original names to tensors, e.g. a
consolidated file loaded with ``mmap=True``, or a sharded directory's reader) the stage's
tensors are read by name instead; only those keys are read.

The module holds the deferred-init context, the per-parameter seeds, the initialiser replay and
the stage binding together (past ~400 lines) because they share one invariant: a parameter's
value depends only on the seed and its first name, whatever stage materialises it.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import inspect
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any, Protocol

import torch
from torch import Tensor, fx, nn

from lightning_autopipe.errors import PlanError
from lightning_autopipe.runtime.inline_init import _RECIPE, FactoryRecorder, replay

__all__ = [
    "Materializer",
    "StateSource",
    "deferred_init",
    "is_deferred",
    "parameter_seed",
    "retarget_devices",
]

_HF_FLAG = "_is_hf_initialized"  # Hugging Face skips tensors that carry it


@contextmanager
def deferred_init() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real.

    A parameter's own construction (``torch.empty`` in ``nn.Linear``) allocates lazily-mapped
    memory that is released at once; initialisers run after registration then act on the meta
    tensor and cost nothing.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            meta = p.to("meta")
            self._parameters[name] = (
                nn.Parameter(meta, requires_grad=p.requires_grad)
                if type(p) is nn.Parameter
                else type(p)(meta, requires_grad=p.requires_grad)
            )
            self._parameters[name].__dict__.update(p.__dict__)

    recorder = FactoryRecorder()

    def register_recorded(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        recipe = recorder.recipe_of(param) if param is not None else None
        register(self, name, param)
        p = self._parameters.get(name)
        if recipe is not None and p is not None:
            p.__dict__[_RECIPE] = recipe

    nn.Module.register_parameter = register_recorded  # type: ignore[method-assign]
    try:
        with recorder:
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.device.type == "meta" for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from (b for b in module.buffers() if b is not None)


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: SHA-256 of ``"<seed>:<name>"``, 63 bits."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def retarget_devices(gm: nn.Module, device: torch.device) -> None:
    """Point the devices a trace baked into a graph (``meta`` for a deferred model, e.g. the
    ``device=`` of an ``arange`` or the target of a ``to``) at ``device``: tensors a stage
    creates itself must live beside its parameters. Other modules are left as they are."""
    if not isinstance(gm, fx.GraphModule):
        return
    meta = gm.meta.setdefault("autopipe", {})
    old = {"meta", str(meta.get("device", "meta"))}
    target = torch.device(device)
    changed = False

    def swap(v: Any) -> Any:
        nonlocal changed
        if isinstance(v, torch.device) and str(v) in old and v != target:
            changed = True
            return target
        return v

    for node in gm.graph.nodes:
        args = fx.node.map_aggregate(node.args, swap)
        kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if changed:
            node.args, node.kwargs = args, kwargs  # type: ignore[assignment]
    meta["device"] = str(target)
    if changed:
        gm.recompile()


class StateSource(Protocol):
    """Where a stage's tensors are read from by name (only the names asked for are read)."""

    def keys(self) -> Iterable[str]: ...

    def load_into(self, targets: Mapping[str, Tensor]) -> None:
        """Copy the saved tensor of every name in ``targets`` into it."""


class _MappingSource:
    """A plain (possibly memory-mapped) ``state_dict``: reading a key touches only its bytes."""

    def __init__(self, state: Mapping[str, Tensor]) -> None:
        self._state = state

    def keys(self) -> Iterable[str]:
        return self._state.keys()

    def load_into(self, targets: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for name, target in targets.items():
                target.copy_(self._state[name])


def _as_source(source: Any) -> StateSource | None:
    if source is None:
        return None
    if hasattr(source, "load_into"):
        return source
    if isinstance(source, Mapping):
        return _MappingSource(source)
    raise TypeError(f"a state source must be a mapping or have load_into, got {type(source)}")


def _sentinel(t: Tensor) -> None:
    """Mark uninitialised memory so a parameter that no initialiser writes is caught."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype is not torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _untouched(t: Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():  # in chunks: no parameter-sized mask
        return any(bool(torch.isnan(c).any()) for c in t.detach().reshape(-1).split(1 << 20))
    if t.dtype is torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all()) and t.numel() > 0


def _takes_one_module(fn: Any) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def _swap(a: Tensor, b: Tensor) -> None:
    try:
        torch.utils.swap_tensors(a, b)
    except RuntimeError:  # a reference cycle may still hold an autograd node: collect, retry
        gc.collect()
        torch.utils.swap_tensors(a, b)


class Materializer:
    """Gives meta tensors of a model real storage on a device, and takes it back.

    Args:
        model: the traced root (the owner of the original names and of the initialisers).
        seed: the run's seed (every rank must pass the same one).
        source: where to read tensors by original name instead of initialising them.
        strict: a parameter that no initialiser writes is an error; otherwise (profiling,
            where random values suffice) it is drawn from ``normal(0, 0.02)``.
    """

    def __init__(
        self, model: nn.Module, seed: int, source: Any = None, strict: bool = True
    ) -> None:
        self.model = model
        self.seed = int(seed)
        self.source = _as_source(source)
        self.strict = strict
        self._names: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)]:
            if t is not None:
                self._names.setdefault(id(t), []).append(name)
        self._saved = set(self.source.keys()) if self.source is not None else set()

    def name_of(self, t: Tensor) -> str:
        names = self._names.get(id(t))
        if not names:
            raise PlanError(
                f"a stage holds a tensor of shape {tuple(t.shape)} on the meta device that no "
                "module of the model holds (a constant the forward creates, which the trace "
                "keeps, or a parameter kept outside the modules), so it cannot be "
                "initialised or loaded by name; register it as a buffer of its module, or "
                "build the model outside configure_model (eagerly)"
            )
        return names[0]

    # ----------------------------------------------------------------------------- public
    def materialize(self, tensors: Iterable[Tensor], device: torch.device) -> int:
        """Give every meta tensor of ``tensors`` storage on ``device``, in place (the same
        Python objects: every module and stage holding them sees the values).

        Returns:
            Bytes materialised.

        Raises:
            PlanError: a checkpoint lacks a name or holds another shape; a parameter no
                initialiser writes (``strict``); a meta buffer no initialiser re-creates.
        """
        todo = _unique(t for t in tensors if t.device.type == "meta")
        # a constant the trace lifted out of the forward (torch.export's ``lifted_tensor_k``:
        # an empty ``torch.tensor([])`` that Hugging Face attention makes per call, made on
        # the meta device while tracing a meta model) belongs to no module and has no values
        for t in [t for t in todo if id(t) not in self._names and t.numel() == 0]:
            _swap(t, self._empty_like(t, device))
        todo = [t for t in todo if t.device.type == "meta"]
        todo.sort(key=lambda t: self.name_of(t))
        ready: dict[int, Tensor] = {id(t): self._empty_like(t, device) for t in todo}
        loaded = self._load(todo, ready)
        for t in todo:
            if id(t) not in loaded:
                self._initialise(t, ready[id(t)])
        for t in todo:
            new = ready[id(t)]
            new.__dict__.update({k: v for k, v in t.__dict__.items() if k != _HF_FLAG})
            _swap(t, new)
        return sum(t.numel() * t.element_size() for t in todo)

    def release(self, tensors: Iterable[Tensor]) -> None:
        """Send ``tensors`` back to the meta device (their storage is freed, and host memory
        handed back to the system: see :func:`_give_back_host_memory`)."""
        host = False
        for t in _unique(tensors):
            if t.device.type == "meta":
                continue
            host = host or t.device.type == "cpu"
            if isinstance(t, nn.Parameter):
                t.grad = None
            meta = self._empty_like(t, torch.device("meta"))
            meta.__dict__.update(t.__dict__)
            _swap(t, meta)
            del meta
        if host:
            _give_back_host_memory()

    @contextmanager
    def holding(self, tensors: Iterable[Tensor], device: torch.device) -> Iterator[int]:
        """Materialise the meta ones of ``tensors`` for the block, release them afterwards."""
        todo = _unique(t for t in tensors if t.device.type == "meta")
        nbytes = self.materialize(todo, device)
        try:
            yield nbytes
        except BaseException:
            # the traceback may still hold the block's graph: do not hide the error
            with suppress(RuntimeError):
                self.release(todo)
            raise
        self.release(todo)

    # -------------------------------------------------------------------------- internals
    @staticmethod
    def _empty_like(t: Tensor, device: torch.device) -> Tensor:
        data = torch.empty(t.shape, dtype=t.dtype, device=device)
        if isinstance(t, nn.Parameter):
            return nn.Parameter(data, requires_grad=t.requires_grad)
        return data

    def _load(self, todo: list[Tensor], ready: dict[int, Tensor]) -> set[int]:
        """Read what the source holds (every meta parameter must be there)."""
        if self.source is None:
            return set()
        targets: dict[str, Tensor] = {}
        done: set[int] = set()
        missing = []
        for t in todo:
            name = next((n for n in self._names[id(t)] if n in self._saved), None)
            if name is None:
                if isinstance(t, nn.Parameter):
                    missing.append(self.name_of(t))
                continue  # a non-persistent buffer: its initialiser re-creates it
            targets[name] = ready[id(t)].detach()
            done.add(id(t))
        if missing:
            raise PlanError(
                f"the checkpoint lacks {len(missing)} parameters of this stage: {missing[:6]}; "
                "load a checkpoint of this model (its state_dict names), or build the model "
                "without ckpt_path to initialise it"
            )
        try:
            self.source.load_into(targets)
        except RuntimeError as exc:
            raise PlanError(
                f"a stage tensor does not match the checkpoint ({exc}); load a checkpoint of "
                "this model with the same configuration"
            ) from exc
        return done

    def _initialise(self, t: Tensor, new: Tensor) -> None:
        """Run the initialisers for ``t`` alone, writing into ``new`` (``t`` stays meta)."""
        name = self.name_of(t)
        with torch.no_grad():
            _sentinel(new)
        _swap(t, new)  # t is real (and unflagged), new holds the meta tensor
        try:
            with _seeded(parameter_seed(self.seed, name), t.device), torch.no_grad():
                recipe = new.__dict__.get(_RECIPE)  # inline construction, replayed first
                ran = recipe is not None and replay(recipe, t)
                ran = self._run_initialisers(name) or ran
                if _untouched(t) and not self.strict and isinstance(t, nn.Parameter):
                    t.normal_(0.0, 0.02)
                    ran = True
        finally:
            _swap(t, new)
        if not ran or _untouched(new):
            kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
            raise PlanError(
                f"{kind} {name!r} of a model built on the meta device is written by none of "
                "its initialisers (the owner's reset_parameters(), an ancestor's "
                "_init_weights(module)); give its module a reset_parameters() that initialises "
                "it, load a checkpoint (ckpt_path=...), or build it for real"
                + ("" if kind == "parameter" else
                   " (buffers are kept real under AutoPipeStrategy.tensor_init_context() / "
                   "trainer.init_module(); a plain torch.device('meta') loses them)")
            )

    def _run_initialisers(self, name: str) -> bool:
        path = name.rpartition(".")[0]
        parts = path.split(".") if path else []
        chain = [self.model.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        ran = False
        owner = chain[0]
        for fn in ("reset_parameters", "_reset_parameters"):
            method = getattr(owner, fn, None)
            if callable(method) and _takes_nothing(method):
                method()
                ran = True
                break
        for depth, module in enumerate(chain):  # children before parents, as HF's apply
            init = next(
                (a._init_weights for a in chain[depth:]
                 if callable(getattr(a, "_init_weights", None))
                 and _takes_one_module(a._init_weights)),
                None,
            )
            if init is not None:
                init(module)
                ran = True
        return ran


def _takes_nothing(fn: Any) -> bool:
    try:
        return not [p for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False


def _give_back_host_memory() -> None:
    """Return freed heap memory to the system (glibc ``malloc_trim``; elsewhere nothing).

    After the first large tensor is freed glibc raises its mmap threshold, so the next blocks'
    parameters come from the heap, whose freed chunks stay resident: profiling block after
    block would then keep up to the whole model resident although one block is alive. Trimming
    after each released block keeps the resident set to what is alive.
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in tensors:
        if t is not None:
            seen.setdefault(id(t), t)
    return list(seen.values())


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The default generator of ``device`` seeded with ``seed``; every state restored after."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if (
        device.type == "cuda") else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[cuda[0]].manual_seed(seed)
        yield
