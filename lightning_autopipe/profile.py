"""Per-block costs of a split model: the measured input every planner works from.

A :class:`Profile` round-trips to JSON so a plan can be made on a laptop for a cluster the
laptop is not. The JSON form is fixed (outside tools read it)::

    {"model": "gpt2", "micro_batch_size": 4, "device": "cpu",
     "blocks": [{"name": "transformer.h.0.attn", "forward_ms": 1.2, "backward_ms": 2.5,
                 "param_bytes": 1048576, "activation_bytes": 65536, "memory_bytes": 262144}]}

A block may also carry ``"forward_fixed_ms"`` / ``"backward_fixed_ms"``: the part of its time
that does not scale with the samples (per-call overhead). They are written only when non-zero
and default to 0 (purely linear costs), so profiles without them stay valid. A unit of ``n``
samples costs :func:`affine_ms` = ``fixed + (ms - fixed) * n / micro_batch_size``.

A block may also carry ``"backward_input_ms"`` and ``"backward_weight_ms"`` (both or neither):
its backward measured as the gradient with respect to its inputs and, separately, with respect
to its weights, which zero-bubble schedules run as two actions. Without them a split backward
is priced as :data:`DEFAULT_INPUT_SHARE` of ``backward_ms`` for the input part and the rest for
the weight part (for the matrix products that dominate a block, the two gradients cost one
product each).

An optional top-level ``"fingerprint"`` (a hash of the block graph) lets a saved Plan be
checked against the model it is used with.

This module is pure data (JSON round-trip, no torch), so the planner reads profiles without
importing torch; measuring one is :func:`lightning_autopipe.runtime.profiler.profile_blocks`.
"""

from __future__ import annotations

import json
import numbers
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_autopipe.errors import InputError

__all__ = [
    "DEFAULT_INPUT_SHARE",
    "BlockProfile",
    "Profile",
    "affine_ms",
    "fit_affine",
    "median_profile",
]


#: The input gradient's share of a backward when a profile does not measure the split.
DEFAULT_INPUT_SHARE = 0.5


def affine_ms(ms: float, fixed_ms: float, ratio: float) -> float:
    """Cost of ``ratio`` x the profiled samples: ``fixed_ms + (ms - fixed_ms) * ratio``.

    ``ms`` is the time measured at ``Profile.micro_batch_size`` samples, ``fixed_ms`` the part of
    it that does not scale with samples, ``ratio = n / micro_batch_size``. With ``fixed_ms == 0``
    this is exactly the linear model ``ms * ratio``.
    """
    if fixed_ms == 0.0:
        return ms * ratio
    return fixed_ms + (ms - fixed_ms) * ratio


def fit_affine(n_small: int, t_small: float, n_big: int, t_big: float) -> float:
    """Fixed part of ``t(n) = fixed + per_sample * n`` through two timings (``n_small < n_big``).

    Clamped to ``[0, 0.9 * t_big]``: timings are noisy, and a noisy small-batch run can make the
    line cross the axis below zero (negative fixed cost) or above ``t_big`` (a negative
    per-sample cost); both would make larger batches look cheaper than they are.
    """
    if not 0 < n_small < n_big:
        raise ValueError(f"need 0 < n_small < n_big, got {n_small}, {n_big}")
    per_sample = (t_big - t_small) / (n_big - n_small)
    fixed = t_big - per_sample * n_big
    return min(max(fixed, 0.0), 0.9 * t_big)


#: Above any real block's milliseconds or bytes (31,000 years; a petabyte), and far enough
#: below float overflow that sums over blocks, micro-batches and steps stay finite.
_MOST = 1e15


@dataclass(frozen=True)
class BlockProfile:
    """Costs of one block for one micro-batch of ``Profile.micro_batch_size`` samples.

    Attributes:
        name: the block's name (its module path, e.g. ``transformer.h.0.attn``).
        forward_ms: median forward time.
        backward_ms: median backward time.
        param_bytes: bytes of the parameters the block owns (tied copies counted where used).
        activation_bytes: bytes of the values the block sends to the next block.
        memory_bytes: activation memory held for backward for one micro-batch.
        forward_fixed_ms: the part of ``forward_ms`` that does not scale with samples.
        backward_fixed_ms: the part of ``backward_ms`` that does not scale with samples.
        backward_input_ms: the backward's input-gradient part, measured on its own (or None).
        backward_weight_ms: the backward's weight-gradient part, measured on its own (or None).
        shared_input_bytes: the part of ``memory_bytes`` that is this block's inputs which the
            previous block saves as well (a ReLU saves its output, the convolution after it
            saves that as its input): one storage, counted in both blocks' ``memory_bytes``, so
            a stage holding both counts it once (``sum(memory_bytes) - shared_input_bytes`` of
            every block after its first).
        loss_bytes: the part of ``memory_bytes`` that only the training loss on this block's
            outputs saves (the last block, profiled with its loss: a causal LM's
            log-probabilities, the size of its logits). A split backward's ``B`` frees it (the
            loss's autograd nodes lie above every weight), while the rest is held until ``W``.
        tied_to: the nearest earlier block that uses parameters this block uses too (a
            language model's head tied to its embedding; the previous use of a module applied
            in several places), or -1.
        tied_bytes: the bytes of the parameters shared with that block, counted in
            ``param_bytes`` here and in the earlier block's: a stage (or a rank's chunks)
            holding both holds them once.
    """

    name: str
    forward_ms: float
    backward_ms: float
    param_bytes: int
    activation_bytes: int
    memory_bytes: int
    forward_fixed_ms: float = 0.0
    backward_fixed_ms: float = 0.0
    backward_input_ms: float | None = None
    backward_weight_ms: float | None = None
    shared_input_bytes: int = 0
    loss_bytes: int = 0
    tied_to: int = -1
    tied_bytes: int = 0

    def __post_init__(self) -> None:
        for key in ("forward_ms", "backward_ms", "forward_fixed_ms", "backward_fixed_ms",
                    "backward_input_ms", "backward_weight_ms", "param_bytes",
                    "activation_bytes", "memory_bytes", "shared_input_bytes", "loss_bytes",
                    "tied_bytes"):
            value = getattr(self, key)
            if value is not None and not (0 <= value < _MOST):
                raise InputError(f"block {self.name!r}: {key} must be a number >= 0 and below "
                                 f"{_MOST:.0e}, got {value!r}; measure the profile again")
        for part, whole in (("forward_fixed_ms", "forward_ms"),
                            ("backward_fixed_ms", "backward_ms")):
            if getattr(self, part) > getattr(self, whole) * (1 + 1e-9) + 1e-12:
                raise InputError(
                    f"block {self.name!r}: {part}={getattr(self, part)!r} exceeds "
                    f"{whole}={getattr(self, whole)!r}; the fixed part is part of the time"
                )
        if self.loss_bytes > self.memory_bytes:
            raise InputError(f"block {self.name!r}: loss_bytes={self.loss_bytes!r} exceeds "
                             f"memory_bytes={self.memory_bytes!r}; the loss's share is part of "
                             "the block's memory (measure the profile again)")
        if self.tied_bytes > self.param_bytes or (self.tied_bytes > 0) != (self.tied_to >= 0):
            raise InputError(f"block {self.name!r}: tied_bytes={self.tied_bytes!r} with "
                             f"tied_to={self.tied_to!r} (param_bytes={self.param_bytes!r}); "
                             "shared parameters are part of the block's and name the earlier "
                             "block that uses them (measure the profile again)")
        if (self.backward_input_ms is None) != (self.backward_weight_ms is None):
            raise InputError(
                f"block {self.name!r}: backward_input_ms and backward_weight_ms come together "
                "(the two parts of a split backward); give both or neither"
            )

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def split_backward(self) -> tuple[float, float, float, float]:
        """(input ms, weight ms, input fixed ms, weight fixed ms) of a split backward.

        The measured parts when the profile has them, else ``backward_ms`` cut at
        :data:`DEFAULT_INPUT_SHARE`; the fixed part is shared in the same proportion.
        """
        if self.backward_input_ms is None or self.backward_weight_ms is None:
            b_in, b_w = DEFAULT_INPUT_SHARE * self.backward_ms, (
                1 - DEFAULT_INPUT_SHARE) * self.backward_ms
        else:
            b_in, b_w = self.backward_input_ms, self.backward_weight_ms
        share = b_in / (b_in + b_w) if b_in + b_w > 0 else DEFAULT_INPUT_SHARE
        return b_in, b_w, share * self.backward_fixed_ms, (1 - share) * self.backward_fixed_ms


@dataclass
class Profile:
    """Ordered block costs of one model at one micro-batch size on one device."""

    model: str
    micro_batch_size: int
    device: str
    blocks: list[BlockProfile]
    fingerprint: str | None = field(default=None)

    def __post_init__(self) -> None:
        mbs = self.micro_batch_size
        if isinstance(mbs, bool) or not isinstance(mbs, numbers.Integral) or mbs < 1:
            raise InputError(f"Profile.micro_batch_size must be an integer >= 1, got {mbs!r}")
        if not isinstance(self.blocks, list | tuple) or not self.blocks:
            raise InputError(f"Profile of {self.model!r} has no blocks (got {self.blocks!r}); "
                             "profile a split model")
        bad = [b for b in self.blocks if not isinstance(b, BlockProfile | dict)]
        if bad:
            raise InputError(f"Profile of {self.model!r}: a block must be a BlockProfile or a "
                             f"mapping of its fields, got {bad[0]!r}")
        self.blocks = [b if isinstance(b, BlockProfile) else BlockProfile(**b) for b in self.blocks]
        late = [i for i, b in enumerate(self.blocks) if b.tied_to >= i]
        if late:
            raise InputError(f"Profile of {self.model!r}: block {late[0]} is tied_to block "
                             f"{self.blocks[late[0]].tied_to}, which is not an earlier block; "
                             "measure the profile again")

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def total_ms(self) -> float:
        """One micro-batch forward and backward through every block: the figure discovery
        compares ranks' speeds by."""
        return sum(b.compute_ms for b in self.blocks)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "micro_batch_size": self.micro_batch_size,
            "device": self.device,
            "blocks": [_block_dict(b) for b in self.blocks],
        }
        if self.fingerprint is not None:
            out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if not isinstance(data, dict):
            raise InputError(f"a profile JSON is an object, got {type(data).__name__}")
        missing = {"model", "micro_batch_size", "device", "blocks"} - set(data)
        if missing:
            raise InputError(f"profile JSON lacks keys {sorted(missing)}")
        _known(data, {"model", "micro_batch_size", "device", "blocks", "fingerprint"},
               "profile JSON")
        if not isinstance(data["blocks"], list) or not all(
                isinstance(b, dict) for b in data["blocks"]):
            raise InputError("profile JSON: 'blocks' must be a list of objects, one per block")
        mbs = data["micro_batch_size"]
        if isinstance(mbs, bool) or not isinstance(mbs, int | float) or mbs != int(mbs):
            raise InputError(f"profile JSON: micro_batch_size must be an integer, got {mbs!r}")
        keys = {f for f in BlockProfile.__dataclass_fields__} - set(_OPTIONAL)
        blocks = []
        for i, b in enumerate(data["blocks"]):
            lacking = keys - set(b)
            if lacking:
                raise InputError(f"profile block {i} lacks keys {sorted(lacking)}")
            _known(b, keys | set(_OPTIONAL), f"profile block {i} ({b.get('name')!r})")
            try:
                blocks.append(
                    BlockProfile(
                        name=str(b["name"]),
                        forward_ms=float(b["forward_ms"]),
                        backward_ms=float(b["backward_ms"]),
                        param_bytes=int(b["param_bytes"]),
                        activation_bytes=int(b["activation_bytes"]),
                        memory_bytes=int(b["memory_bytes"]),
                        **{k: float(b[k]) for k in _OPTIONAL if k in b and k not in _INTS},
                        **{k: int(b[k]) for k in _INTS if k in b},
                    )
                )
            except InputError:
                raise
            except (TypeError, ValueError, OverflowError) as exc:
                raise InputError(f"profile block {i} ({b.get('name')!r}): a field is not a "
                                 f"number ({exc}); measure the profile again") from None
        return cls(
            model=str(data["model"]),
            micro_batch_size=int(data["micro_batch_size"]),
            device=str(data["device"]),
            blocks=blocks,
            fingerprint=data.get("fingerprint"),
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(Path(path).read_text())


# JSON keys written only when non-zero (the fixed parts, the shared and loss bytes) or known
# (the backward's split)
_OPTIONAL = ("forward_fixed_ms", "backward_fixed_ms", "backward_input_ms", "backward_weight_ms",
             "shared_input_bytes", "loss_bytes", "tied_to", "tied_bytes")
_INTS = ("shared_input_bytes", "loss_bytes", "tied_to", "tied_bytes")


def _known(data: dict[str, Any], allowed: set[str], where: str) -> None:
    """A key the reader does not know is refused, not ignored: a misspelt optional time (say
    ``backward_weigth_ms``) would otherwise plan silently without it."""
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; the keys a profile holds are "
                         f"{sorted(allowed)} (fix the spelling, or measure the profile again)")


def _block_dict(b: BlockProfile) -> dict[str, Any]:
    d = asdict(b)
    for k in _OPTIONAL:
        absent = d[k] < 0 if k == "tied_to" else (
            d[k] is None or (not d[k] and (k.endswith("fixed_ms") or k in _INTS)))
        if absent:
            del d[k]
    return d

def median_profile(profiles: list[Profile]) -> Profile:
    """Block by block, the median times of several profiles of the same blocks and size.

    On a shared machine one profiling pass can land in a noisy second and skew a block (or a
    whole micro-batch size) by 10%; profiling in rounds (e.g. interleaving the micro-batch
    sizes a planner compares) and taking the median keeps such a pass from deciding the plan.
    """
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    first = profiles[0]
    for p in profiles[1:]:
        if p.names != first.names or p.micro_batch_size != first.micro_batch_size:
            raise ValueError(
                "median_profile: profiles differ in blocks or micro-batch size; combine only "
                "profiles of the same split model at the same micro-batch size"
            )
    times = ("forward_ms", "backward_ms", "forward_fixed_ms", "backward_fixed_ms")
    split = ("backward_input_ms", "backward_weight_ms")
    blocks = []
    for i, b in enumerate(first.blocks):
        med = {f: statistics.median(getattr(p.blocks[i], f) for p in profiles) for f in times}
        parts = [[getattr(p.blocks[i], f) for p in profiles] for f in split]
        known = all(v is not None for vs in parts for v in vs)
        for f, vs in zip(split, parts):
            med[f] = statistics.median(vs) if known else None
        blocks.append(BlockProfile(**{**asdict(b), **med}))
    return Profile(first.model, first.micro_batch_size, first.device, blocks, first.fingerprint)

