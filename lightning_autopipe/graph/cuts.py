"""Choose block boundaries: group graph nodes by submodule, then cut where few values are live.

Nodes are keyed by the module that ran them. A *layer* is a child of a container module (a
``ModuleList`` / ``Sequential`` / ``ModuleDict`` holding at least two modules of one class, or a
module whose children are numbered): one transformer layer, one ResNet block. A module that
the model calls several times and that holds a layer's share of its weights (ALBERT's one
shared layer, applied once per depth) is a layer too, and each call of a layer is a layer of
its own: the calls share weights but not work, and a stage boundary may fall between them
(stages holding calls of one module hold its weights as tied). At ``"layer"`` granularity
each layer is one block and the runs of nodes between layers (embeddings, heads) form one
block each. At ``"sub-block"`` granularity a layer is split at its direct children (below
any chain of single wrappers: ALBERT's layer group holding one layer), and children that hold
few parameters (< 8 % of the largest sibling: norms, activations, residual adds) are merged
into a neighbour across whichever of their two boundaries carries *more* live values, which
keeps the boundaries with the fewest live tensors: pre-LN transformers split into attention and
MLP halves with their residual adds, ResNet blocks into their convolution groups.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from lightning_autopipe.errors import OptionError
from lightning_autopipe.graph.analysis import GraphInfo

__all__ = ["Block", "GRANULARITIES", "choose_blocks"]

GRANULARITIES = ("sub-block", "layer")
_LIGHT = 0.08  # a segment with < 8 % of its group's largest parameter count is "light"


@dataclass
class Block:
    """A contiguous run of anchored nodes; ``params`` maps id(param) -> numel it reads."""

    name: str
    nodes: list[fx.Node]
    params: dict[int, int] = field(default_factory=dict)


@dataclass
class _Seg:
    start: int
    stop: int
    key: Any
    group: int
    params: dict[int, int]
    names: dict[str, int]  # candidate name -> parameter count

    @property
    def weight(self) -> int:
        return sum(self.params.values())


def _containers(modules: dict[str, nn.Module]) -> set[str]:
    out = set()
    for path, mod in modules.items():
        kids = list(mod.named_children())
        if len(kids) < 2:
            continue
        if isinstance(mod, nn.ModuleList | nn.Sequential | nn.ModuleDict):
            if Counter(type(k) for _, k in kids).most_common(1)[0][1] >= 2:
                out.add(path)
        elif all(name.isdigit() for name, _ in kids):
            out.add(path)
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _repeated(info: GraphInfo) -> set[str]:
    """The outermost modules that the trace saw called more than once and that hold a
    layer's share of the model's parameters (not a small norm applied in several places,
    which would otherwise take the place of the layers around it)."""
    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    total = size(info.modules[""]) if "" in info.modules else 0
    seen = {p for calls in info.calls.values() for p in calls}
    held = {p for p in seen if p in info.modules
            and size(info.modules[p]) > 0 and size(info.modules[p]) >= _LIGHT * total}
    return {p for p in held if not any(p.startswith(q + ".") for q in held)}


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _layer_paths(info: GraphInfo, used: set[str]) -> set[str]:
    """The layers; ``used``: the module paths of the graph's nodes."""
    modules = info.modules
    layers = {
        _join(c, name) for c in _containers(modules) for name, _ in modules[c].named_children()
    }
    layers = {lay for lay in layers if any(p == lay or p.startswith(lay + ".") for p in used)}
    # a module with weights called several times is a layer, unless it lies in one or holds one
    layers |= {r for r in _repeated(info) if not any(_related(r, lay) for lay in layers)}
    if not layers:  # no repeated structure: the children of the outermost real module
        layers = _children("", used)
        # a wrapper (a LightningModule's ``self.net``) holds the model as its only child:
        # descend until there is a choice (the wrapper's own glue joins a neighbour block)
        while len(layers) == 1:
            inner = _children(next(iter(layers)), used)
            if not inner:
                break
            layers = inner
    return layers


def _below_wrappers(layer: str, used: set[str]) -> str:
    """Where ``layer`` splits into sub-blocks: itself, or below a chain of modules that each
    hold all of its work in one child (ALBERT's layer group holding its one layer)."""
    root = layer
    while len(kids := _children(root, used)) == 1:
        (only,) = kids
        if not _children(only, used):
            break
        root = only
    return root


def _children(prefix: str, used: set[str]) -> set[str]:
    """The direct children of module ``prefix`` ("" = root) through which ``used`` paths run."""
    out = set()
    for p in used:
        if prefix and not p.startswith(prefix + "."):
            continue
        rest = p[len(prefix) + 1 :] if prefix else p
        out.add(_join(prefix, rest.split(".")[0]))
    return out


def _keys(info: GraphInfo, granularity: str) -> list[Any]:
    used = {p for p in info.path.values() if p}
    layers = _layer_paths(info, used)
    wrappers = {""} | {lay.rsplit(".", 1)[0] for lay in layers if "." in lay}
    for w in list(wrappers):
        parts = w.split(".")
        wrappers |= {".".join(parts[:i]) for i in range(1, len(parts))}

    def layer_of(path: str) -> str | None:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) in layers:
                return ".".join(parts[:i])
        return None

    split_at = {lay: _below_wrappers(lay, used) for lay in layers}
    keys: list[Any] = []
    for n in info.anchored:
        p = info.path[n]
        if p is None or p in wrappers:
            keys.append(None)
            continue
        lay = layer_of(p)
        if lay is None:
            keys.append(("O", p))
            continue
        call = info.calls.get(n, {}).get(lay, 0)
        if granularity == "layer":
            keys.append(("L", lay, call))
        else:
            root = split_at[lay]
            child = root + "." + p[len(root) + 1 :].split(".")[0] if p.startswith(
                root + ".") else None
            keys.append(("S", lay, child, call))
    known = [i for i, k in enumerate(keys) if k is not None]
    if not known:
        return [("O", "root")] * len(keys)
    last = keys[known[0]]
    for i, k in enumerate(keys):  # glue (no module) joins the run before it
        if k is None:
            keys[i] = last
        else:
            last = k
    return keys


def _node_params(info: GraphInfo, memo: dict[fx.Node, dict[int, int]], n: fx.Node) -> dict:
    if n in memo:
        return memo[n]
    out = dict(info.params_of.get(n, {}))
    for a in _args(n):
        if a in info.floating:
            out.update(_node_params(info, memo, a))
    memo[n] = out
    return out


def _args(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.map_arg((n.args, n.kwargs), lambda a: found.append(a) or a)
    return found


def _live(info: GraphInfo) -> dict[fx.Node, tuple[int, int]]:
    """Value -> the boundaries ``[start, end]`` it crosses (boundary p is before anchored
    node p; the last, ``len(anchored)``, leads to the outputs); values crossing none left out."""
    count = len(info.anchored)
    pos = {n: i for i, n in enumerate(info.anchored)}
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(info.anchored):
        for v in info.reqs(n)[0]:
            last[v] = max(last.get(v, -1), i)
    for leaf in info.traced.output_leaves:
        if isinstance(leaf, fx.Node):
            deps = {leaf} if info.is_value(leaf) else set(info.reqs(leaf)[0])
            for v in deps:
                last[v] = count
    spans = {v: (pos.get(v, -1) + 1, end) for v, end in last.items()}
    return {v: (a, b) for v, (a, b) in spans.items() if a <= b}


def _aliased_boundaries(info: GraphInfo, live: dict[fx.Node, tuple[int, int]]) -> set[int]:
    """Boundaries two aliases of a storage written in place cross together: sent as two
    tensors, a write through one would no longer reach the other (the model's view and base
    would part), so no cut may fall there."""
    out: set[int] = set()
    for root in info.mutated_roots:
        spans = [span for v, span in live.items() if info.alias_root.get(v) is root]
        for p in {p for a, b in spans for p in range(a, b + 1)}:
            if sum(a <= p <= b for a, b in spans) > 1:
                out.add(p)
    return out


def _boundary_costs(
    info: GraphInfo, live: dict[fx.Node, tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """For boundary p (before anchored node p): (non-tensor values, tensor count, bytes)."""
    count = len(info.anchored)
    diff = [[0, 0, 0] for _ in range(count + 2)]
    for v, (start, end) in live.items():
        meta = info.meta.get(v)
        row = (0, 1, meta.nbytes) if meta and meta.is_tensor else (1, 0, 0)
        for k in range(3):
            diff[start][k] += row[k]
            diff[end + 1][k] -= row[k]
    costs, run = [], [0, 0, 0]
    for p in range(count + 1):
        run = [run[k] + diff[p][k] for k in range(3)]
        costs.append((run[0], run[1], run[2]))
    return costs


def _merge(a: _Seg, b: _Seg) -> _Seg:
    names = dict(a.names)
    for k, v in b.names.items():
        names[k] = names.get(k, 0) + v
    return _Seg(a.start, b.stop, a.key, a.group, {**a.params, **b.params}, names)


def _merge_group(segs: list[_Seg], costs: list[tuple[int, int, int]], whole: bool) -> list[_Seg]:
    if whole:
        out = segs[0]
        for s in segs[1:]:
            out = _merge(out, s)
        return [out]
    while len(segs) > 1:
        top = max(s.weight for s in segs)
        light = [i for i, s in enumerate(segs) if s.weight == 0 or s.weight < _LIGHT * top]
        if not light:
            break
        i = light[0]
        if i == 0:
            j = 0
        elif i == len(segs) - 1:
            j = i - 1
        else:  # drop the boundary carrying more (ties: merge into the earlier segment)
            left, right = costs[segs[i].start], costs[segs[i].stop]
            j = i - 1 if left >= right else i
        segs[j : j + 2] = [_merge(segs[j], segs[j + 1])]
    return segs


def choose_blocks(info: GraphInfo, granularity: str = "sub-block") -> list[Block]:
    """Split ``info``'s anchored nodes into an ordered chain of blocks (see module docstring)."""
    if granularity not in GRANULARITIES:
        raise OptionError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    nodes = info.anchored
    if not nodes:
        return []
    keys = _keys(info, granularity)
    memo: dict[fx.Node, dict[int, int]] = {}
    live = _live(info)
    costs = _boundary_costs(info, live)
    aliased = _aliased_boundaries(info, live)
    segs: list[_Seg] = []
    group, prev_gid = 0, None
    for i, (n, key) in enumerate(zip(nodes, keys)):
        params = _node_params(info, memo, n)
        gid = ("layer", key[1], key[-1]) if key[0] in ("L", "S") else ("outside",)
        if segs and key == segs[-1].key:
            seg = segs[-1]
            seg.stop = i + 1
            seg.params.update(params)
            seg.names[_name(key)] = seg.weight
            continue
        if gid != prev_gid:
            group += 1
            prev_gid = gid
        segs.append(_Seg(i, i + 1, key, group, dict(params), {_name(key): sum(params.values())}))
    # Never cut where a non-tensor value is live, or two aliases of a storage written in
    # place: merge across such boundaries first.
    merged: list[_Seg] = [segs[0]]
    for s in segs[1:]:
        if costs[s.start][0] > 0 or s.start in aliased:
            merged[-1] = _merge(merged[-1], s)
        else:
            merged.append(s)
    out: list[_Seg] = []
    start = 0
    while start < len(merged):
        stop = start
        while stop < len(merged) and merged[stop].group == merged[start].group:
            stop += 1
        out += _merge_group(merged[start:stop], costs, whole=granularity == "layer")
        start = stop
    # A block without parameters is folded into its predecessor (or successor when first).
    final: list[_Seg] = []
    for s in out:
        if final and (s.weight == 0 or final[-1].weight == 0):
            final[-1] = _merge(final[-1], s)
        else:
            final.append(s)
    blocks = _named(final, nodes)
    for leaf in info.traced.output_leaves:  # an output computed from parameters alone is
        if isinstance(leaf, fx.Node) and leaf in info.floating:  # computed by the last block
            blocks[-1].params.update(_node_params(info, memo, leaf))
    return blocks


def _name(key: Any) -> str:
    if key[0] == "S":
        return key[2] or key[1]
    return key[1]


def _named(segs: list[_Seg], nodes: list[fx.Node]) -> list[Block]:
    blocks: list[Block] = []
    seen: Counter[str] = Counter()
    for s in segs:
        name = max(s.names.items(), key=lambda kv: kv[1])[0]
        seen[name] += 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        blocks.append(Block(name, nodes[s.start : s.stop], dict(s.params)))
    return blocks
