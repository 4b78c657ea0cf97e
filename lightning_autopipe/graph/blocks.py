"""``split_model`` and ``BlockGraph``: a model as a chain of blocks, regroupable into stages.

Boundary ``k`` (``0 <= k <= len(blocks)``) is the ordered tuple of tensors flowing from blocks
``< k`` into blocks ``>= k``: boundary 0 is the model's flattened inputs, the last one its
flattened outputs, and values that skip blocks (residual streams, masks, position ids) appear in
every boundary they cross. A stage ``[i, j)`` maps boundary ``i`` to boundary ``j``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn

from lightning_autopipe.errors import (
    BlockRangeError,
    GraphRunError,
    InputError,
    OptionError,
    TraceError,
)
from lightning_autopipe.graph.analysis import GraphInfo, analyze
from lightning_autopipe.graph.cuts import GRANULARITIES, Block, choose_blocks
from lightning_autopipe.graph.numbers import CapturedNumber, numbers_of
from lightning_autopipe.graph.stage import (
    StageIO,
    StageModule,
    TieGroup,
    ValueInfo,
    adopt_orphans,
    build_stage,
)
from lightning_autopipe.graph.trace import Inputs, trace, unfaithful_fx, warn_kept_mode

__all__ = ["BlockGraph", "split_model"]


def split_model(
    model: nn.Module,
    example_inputs: Any,
    granularity: str = "sub-block",
    tracer: str = "auto",
) -> BlockGraph:
    """Trace ``model`` and cut it into an ordered chain of blocks.

    Args:
        model: an ``nn.Module``, or a ready ``torch.fx.GraphModule`` (used as is).
        example_inputs: a tuple of positional tensors or a dict of keyword tensors; run once
            to record value shapes (buffers such as BatchNorm statistics are restored after).
        granularity: ``"sub-block"`` (attention / MLP halves, convolution groups) or
            ``"layer"`` (one transformer layer / residual block per block).
        tracer: ``"auto"`` (fx, then torch.export), ``"fx"`` or ``"export"``.

    Raises:
        TraceError: the model cannot be captured (message names the construct and remedies).
        InputError: ``example_inputs`` do not fit the model.
    """
    if granularity not in GRANULARITIES:
        raise OptionError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    traced = trace(model, example_inputs, tracer)
    try:
        info = analyze(traced, traced.flatten(example_inputs))
    except GraphRunError as exc:  # an input problem, or an fx graph that is not the model's
        if traced.tracer != "fx":
            raise
        traced = unfaithful_fx(model, example_inputs, tracer, exc)
        info = analyze(traced, traced.flatten(example_inputs))
    warn_kept_mode(traced)
    blocks = choose_blocks(info, granularity)
    if not blocks:
        raise TraceError(f"{type(model).__name__} has no computation to split")
    return BlockGraph(info, blocks, granularity)


class BlockGraph:
    """The blocks of one traced model; see the module docstring for boundaries.

    Attributes:
        names: ordered block names (module paths such as ``transformer.h.0.attn``).
        granularity: the granularity it was split at.
        tracer: the front end used: ``"fx"``, ``"export"`` or ``"graph_module"``.
        dynamic_batch: whether inputs may have another batch size than the example's.
        notes: what the capture chose on its way and why (torch.export instead of an fx graph
            that failed where the model runs; a static batch), for the set-up log.
    """

    def __init__(self, info: GraphInfo, blocks: list[Block], granularity: str):
        self._info = info
        self._blocks = blocks
        self.names = [b.name for b in blocks]
        self.granularity = granularity
        self.tracer = info.traced.tracer
        self.dynamic_batch = info.traced.dynamic_batch
        self.notes = list(info.traced.notes)
        self._stages: dict[tuple[int, int], StageModule] = {}
        self._original_names = _original_names(info)
        self._needs = self._compute_needs()
        self._boundaries = self._compute_boundaries()
        self.fingerprint = self._fingerprint()
        #: the modules' numbers at the capture (:func:`~.numbers.changed_numbers` after)
        self.numbers = self._captured_numbers()
        self._orphans: dict[str, Tensor] | None = None

    # ------------------------------------------------------------------------- structure
    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"BlockGraph({len(self)} blocks, {self.granularity}, tracer={self.tracer})"

    def _captured_numbers(self) -> list[CapturedNumber]:
        """The numbers the model's modules hold at the capture, which the graph may keep as
        constants (:mod:`~.numbers`)."""
        traced = self._info.traced
        called = ({n.target for n in traced.gm.graph.nodes if n.op == "call_module"}
                  if traced.tracer == "fx" else set())
        return numbers_of(traced.model, called)

    @property
    def model(self) -> nn.Module:
        """The module the blocks were traced from (owner of the original names)."""
        return self._info.traced.model

    def _compute_needs(self) -> list[dict[fx.Node, None]]:
        info = self._info
        all_needs = []
        last = len(self._blocks) - 1
        for b, block in enumerate(self._blocks):
            computed: dict[fx.Node, None] = {}
            needs: dict[fx.Node, None] = {}
            consumers: list[Any] = list(block.nodes)
            if b == last:
                consumers += [v for v in info.traced.output_leaves if isinstance(v, fx.Node)]
            members = set(block.nodes)
            for n in consumers:
                if n in members:
                    values, syms = info.reqs(n)
                elif info.is_value(n):
                    values, syms = frozenset([n]), frozenset()
                elif info.is_sym_leaf(n):
                    values, syms = frozenset(), frozenset([n])
                else:
                    values, syms = info.reqs(n)
                for v in sorted(values, key=info.index.__getitem__):
                    if v not in computed:
                        needs[v] = None
                for s in syms:
                    expr = s.meta["val"].node.expr
                    have = list(needs) + list(computed)
                    if not any(expr in info.sym_dims(v) for v in have):
                        src = s.args[0]
                        if info.is_value(src) and src not in computed:
                            needs[src] = None
                if n in members:
                    computed[n] = None
            all_needs.append(needs)
        return all_needs

    def _compute_boundaries(self) -> list[list[fx.Node]]:
        info = self._info
        defined: dict[fx.Node, int] = {v: -1 for v in info.traced.input_nodes}
        for b, block in enumerate(self._blocks):
            for n in block.nodes:
                defined[n] = b
        bounds = [list(info.traced.input_nodes)]
        for k in range(1, len(self._blocks)):
            crossing = {
                v for b in range(k, len(self._blocks)) for v in self._needs[b] if defined[v] < k
            }
            values = sorted(crossing, key=info.index.__getitem__)
            for v in values:
                meta = info.meta.get(v)
                if meta is None or not meta.is_tensor:
                    raise TraceError(
                        f"non-tensor value {v.name} ({v.op} {v.target}) would cross the boundary "
                        f"before block {k} ({self.names[k]}); only tensors may cross stages. "
                        "Use granularity='layer' or restructure the module so it returns tensors"
                    )
            bounds.append(values)
        bounds.append([v for v in info.traced.output_leaves if isinstance(v, fx.Node)])
        return bounds

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        for block in self._blocks:
            h.update(block.name.encode())
            for n in block.nodes:
                h.update(f"{n.op}:{_target_name(n.target)};".encode())
        for k, bound in enumerate(self._boundaries):
            h.update(f"|{k}:{len(bound)}".encode())
        for name, p in self.model.named_parameters():
            h.update(f"{name}{tuple(p.shape)}".encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------------- checks
    def _check_range(self, i: int, j: int) -> None:
        n = len(self)
        if not (isinstance(i, int) and isinstance(j, int)) or not 0 <= i < j <= n:
            raise BlockRangeError(
                f"block range [{i}, {j}) is not a non-empty range inside [0, {n}]; stages take "
                f"0 <= i < j <= {n} (the model has {n} blocks: {self.names[0]} .. "
                f"{self.names[-1]})"
            )

    def _check_cuts(self, cuts: list[int]) -> list[tuple[int, int]]:
        cuts = list(cuts)
        n = len(self)
        if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != n:
            raise BlockRangeError(
                f"cuts {cuts} must start at 0 and end at len(blocks) = {n}, e.g. [0, {n // 2 or 1}"
                f", {n}]"
            )
        pairs = list(zip(cuts[:-1], cuts[1:]))
        for i, j in pairs:
            if j <= i:
                raise BlockRangeError(f"cuts {cuts} must be strictly increasing ({i} -> {j})")
            self._check_range(i, j)
        return pairs

    # ------------------------------------------------------------------------- stages
    def stage(self, i: int, j: int) -> StageModule:
        """The module for blocks ``[i, j)``: ``stage(*boundary_i) -> tuple(boundary_j)``.

        It owns (and shares with the original model) the parameters and buffers it uses, under
        the original qualified names; ``stage.param_names`` maps its ``state_dict`` keys to the
        original ``state_dict`` names. Built once per range and cached.
        """
        self._check_range(i, j)
        if (i, j) not in self._stages:
            stage = self._build(i, j)
            if j == len(self):
                adopt_orphans(stage, self.orphans)
            self._stages[(i, j)] = stage
        return self._stages[(i, j)]

    def _build(self, i: int, j: int) -> StageModule:
        return build_stage(self._info, [b.nodes for b in self._blocks[i:j]],
                           self._boundaries[i], self._boundaries[j], (i, j),
                           self._original_names)

    @property
    def orphans(self) -> dict[str, Tensor]:
        """The model's ``state_dict`` entries (by their first name) that no block reads: the
        last stage holds them (:func:`~.stage.adopt_orphans`)."""
        if self._orphans is None:
            held = {id(t) for t in self._build(0, len(self)).state_dict(keep_vars=True).values()}
            self._orphans = {}
            for name, t in self.model.state_dict(keep_vars=True).items():
                if id(t) not in held:
                    held.add(id(t))  # a tensor under several names is adopted once
                    self._orphans[name] = t
        return self._orphans

    def keep_stages(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Forget the cached stage modules of every range but ``ranges`` (the running plan's).

        A live re-plan reads the stages of candidate plans at its checks; without this the
        cache would keep one module per range ever considered. A forgotten range is built
        again when asked for (a new module object).
        """
        keep = {(int(i), int(j)) for i, j in ranges}
        for key in [k for k in self._stages if k not in keep]:
            del self._stages[key]

    def stage_io(self, i: int, j: int) -> StageIO:
        """Names, shapes (at the traced batch), dtypes and gradient flags of a range's I/O."""
        self._check_range(i, j)
        return StageIO((i, j), self.boundary(i), self.boundary(j))

    def boundary(self, k: int) -> tuple[ValueInfo, ...]:
        """The values crossing boundary ``k`` (0 = model inputs, ``len`` = model outputs)."""
        if not 0 <= k <= len(self):
            raise BlockRangeError(f"boundary {k} outside [0, {len(self)}]")
        out = []
        for v in self._boundaries[k]:
            meta = self._info.meta.get(v)
            if meta is None or not meta.is_tensor:
                continue
            out.append(ValueInfo(v.name, meta.shape, meta.dtype, meta.requires_grad, meta.nbytes))
        return tuple(out)

    def tie_groups(self, cuts: list[int]) -> list[TieGroup]:
        """Parameters held by several stages of ``cuts`` or under several names."""
        pairs = self._check_cuts(cuts)
        holders: dict[int, dict[int, list[str]]] = {}
        for s, (i, j) in enumerate(pairs):
            for local, p in self.stage(i, j).named_parameters(remove_duplicate=False):
                holders.setdefault(id(p), {}).setdefault(s, []).append(local)
        groups = []
        for pid, stages in holders.items():
            aliases = tuple(self._original_names.get(pid, []))
            if len(stages) > 1 or len(aliases) > 1 or any(len(v) > 1 for v in stages.values()):
                groups.append(
                    TieGroup(
                        name=aliases[0] if aliases else next(iter(stages.values()))[0],
                        aliases=aliases,
                        stages={s: tuple(v) for s, v in stages.items()},
                    )
                )
        return groups

    # ------------------------------------------------------------------------- data
    def flatten_inputs(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        """Model inputs (tuple or dict, any batch size) -> what stage 0 takes."""
        traced = self._info.traced
        flat = traced.flatten(inputs)
        for k, (t, shape) in enumerate(zip(flat, traced.example_shapes)):
            same_rest = t.dim() == len(shape) and tuple(t.shape[1:]) == shape[1:]
            same_batch = self.dynamic_batch or t.dim() == 0 or t.shape[0] == shape[0]
            if not (same_rest and same_batch):
                raise InputError(
                    f"input {k} has shape {tuple(t.shape)} but the model was traced with "
                    f"{shape}; only the batch dimension (dim 0) may differ"
                    + ("" if self.dynamic_batch else " and this export is static: it may not")
                    + ("" if same_rest else "; pad every batch to the traced length (e.g. a "
                       "tokenizer's padding='max_length'), not each to its longest sample")
                )
        return flat

    def unflatten_outputs(self, outputs: tuple[Any, ...]) -> Any:
        """The last stage's output tuple -> what the model returns (tensor, tuple, ModelOutput)."""
        traced = self._info.traced
        leaves = list(traced.output_leaves)
        wanted = sum(isinstance(v, fx.Node) for v in leaves)
        if len(outputs) != wanted:
            raise InputError(f"expected {wanted} output tensors, got {len(outputs)}")
        it = iter(outputs)
        filled = [next(it) if isinstance(v, fx.Node) else v for v in leaves]
        return pytree.tree_unflatten(filled, traced.out_spec)

    def run(self, example_inputs: Inputs, cuts: list[int] | None = None) -> Any:
        """Chain the stage modules of ``cuts`` (default: one stage) on ``example_inputs``."""
        pairs = self._check_cuts(cuts if cuts is not None else [0, len(self)])
        values: tuple[Any, ...] = self.flatten_inputs(example_inputs)
        for i, j in pairs:
            values = self.stage(i, j)(*values)
        return self.unflatten_outputs(values)


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(
        target
    )


def _original_names(info: GraphInfo) -> dict[int, list[str]]:
    """id(tensor) -> its names in the original ``state_dict`` (by identity, else by name)."""
    out: dict[int, list[str]] = {}
    original = info.traced.model.state_dict(keep_vars=True)
    for name, t in original.items():
        out.setdefault(id(t), []).append(name)
    for name, t in info.traced.gm.state_dict(keep_vars=True).items():
        if id(t) not in out and name in original:
            out[id(t)] = [name]
    return out
