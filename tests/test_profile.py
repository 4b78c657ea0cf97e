"""profile_blocks: per-block costs against the whole model and against hand-computed values."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_autopipe import Profile, profile_blocks, split_model
from lightning_autopipe.errors import InputError, OptionError
from lightning_autopipe.profile import BlockProfile, median_profile
from lightning_autopipe.zoo.models import build_model


def _whole_model_ms(model: nn.Module, inputs: tuple, runs: int) -> tuple[float, float]:
    """Fastest forward and backward of the unsplit model over ``runs`` (after a warm-up)."""
    fwd, bwd = [], []
    for r in range(runs + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model(*inputs)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        if r:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    model.zero_grad(set_to_none=True)
    return min(fwd), min(bwd)


@pytest.mark.quiet  # asserts on timings taken in this process
@pytest.mark.parametrize("in_chain", [True, False], ids=["in-chain", "isolated"])
def test_block_costs_sum_to_the_whole_model(in_chain: bool) -> None:
    """Per-block times add up to the whole model's forward and backward time.

    Both ways of timing: inside whole forward-then-backward passes (the CPU default) and each
    block alone.

    Measurement: three profiles interleaved with three timings of the unsplit model; each
    side keeps its fastest value (per block, resp. overall). Other processes on a shared CPU
    only ever *add* time, so minima are stable where single medians swing by 2x.

    Tolerance: the block sums must lie within [0.6, 1.6] x the whole model (measured here:
    about 0.85 forward, 1.0 backward). Each block pays a little Python overhead of its own
    and the unsplit model pays nn.Module call overhead the graph code avoids, hence the
    width; a double-counted model would sit near 2x and one missing its attention or MLP
    halves (about half of the time) below 0.6x.
    """
    torch.manual_seed(0)
    model, example = build_model("tiny_gpt", "small", batch_size=8)  # d 128, 4 layers, seq 64
    blocks = split_model(model, example)
    profiles, whole = [], []
    for _ in range(3):
        profiles.append(profile_blocks(blocks, example, repeats=3, in_chain=in_chain))
        whole.append(_whole_model_ms(model, example, runs=3))
    n = len(blocks)
    fwd = sum(min(p.blocks[b].forward_ms for p in profiles) for b in range(n))
    bwd = sum(min(p.blocks[b].backward_ms for p in profiles) for b in range(n))
    ratio_fwd = fwd / min(w[0] for w in whole)
    ratio_bwd = bwd / min(w[1] for w in whole)
    assert 0.6 <= ratio_fwd <= 1.6, (ratio_fwd, profiles[0].blocks, whole)
    assert 0.6 <= ratio_bwd <= 1.6, (ratio_bwd, profiles[0].blocks, whole)


def test_profile_structure_bytes_and_json() -> None:
    model, example = build_model("tiny_gpt", "tiny", batch_size=3)
    blocks = split_model(model, example)
    prof = profile_blocks(blocks, example, warmup=0, repeats=1, model_name="tiny")
    assert prof.names == blocks.names
    assert prof.micro_batch_size == 3
    assert prof.device == "cpu"
    assert prof.model == "tiny"
    assert prof.fingerprint == blocks.fingerprint
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in prof.blocks)
    # parameters: every block's own, the tied embedding counted in both blocks that use it
    wte = model.wte.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(b.param_bytes for b in prof.blocks) == total + wte.numel() * wte.element_size()
    # activations: what crosses the following boundary
    for k, b in enumerate(prof.blocks):
        assert b.activation_bytes == sum(v.nbytes for v in blocks.boundary(k + 1))
    assert blocks.names[:2] == ["wte", "wpe"]
    # token embeddings (fp32) and the position ids wpe looks up (int64)
    assert prof.blocks[0].activation_bytes == 3 * 16 * 32 * 4 + 16 * 8
    assert Profile.from_json(prof.to_json()) == prof


def test_memory_is_what_autograd_keeps() -> None:
    """Linear + tanh: autograd keeps the Linear's input and the tanh's output, nothing else
    (the weight is a parameter, counted in param_bytes)."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh())
    x = torch.randn(4, 32)
    blocks = split_model(model, (x,))
    assert blocks.names == ["0", "2"]  # the parameter-free tanh joins its Linear
    prof = profile_blocks(blocks, (x,), warmup=0, repeats=1)
    assert [b.memory_bytes for b in prof.blocks] == [4 * (32 + 64) * 4, 4 * (64 + 16) * 4]
    assert [b.param_bytes for b in prof.blocks] == [(32 * 64 + 64) * 4, (64 * 16 + 16) * 4]


@pytest.mark.parametrize("in_chain", [True, False], ids=["in-chain", "isolated"])
def test_profiling_leaves_the_model_as_it_was(in_chain: bool) -> None:
    model, example = build_model("small_cnn_bn", "tiny")
    blocks = split_model(model, example)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = profile_blocks(blocks, example, warmup=1, repeats=2, in_chain=in_chain)
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in prof.blocks)
    assert all(b.forward_fixed_ms >= 0 and b.backward_fixed_ms >= 0 for b in prof.blocks)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # batch-norm statistics restored
    assert all(p.grad is None for p in model.parameters())


def test_bad_repeat_counts() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    blocks = split_model(model, example)
    with pytest.raises(OptionError, match="repeats"):
        profile_blocks(blocks, example, repeats=0)


# ------------------------------------------------------------------------ with the loss
def _small_chain() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh())
    return model, torch.randn(4, 32)


@pytest.mark.quiet  # asserts on timings taken in this process
def test_loss_fn_is_timed_on_the_last_block_only() -> None:
    """A loss that projects the 16 outputs onto a 16384-word vocabulary and takes the
    cross-entropy costs about 100x the two small Linear blocks (64 samples: 16M multiply-adds
    forward, twice that backward, against 0.2M): the last block's times must grow by far more
    than any noise (asserted: 2x), the first block's must not change in kind."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    x = torch.randn(64, 32)
    targets = torch.randint(0, 2**14, (64,))
    vocab = torch.randn(16, 2**14)
    calls: list[int] = []

    def loss_fn(outputs: tuple, n: int) -> torch.Tensor:
        calls.append(n)
        return nn.functional.cross_entropy(outputs[0] @ vocab, targets[:n])

    blocks = split_model(model, (x,))
    assert len(blocks) == 2
    plain = [profile_blocks(blocks, (x,), repeats=3) for _ in range(2)]
    lossy = [profile_blocks(blocks, (x,), repeats=3, loss_fn=loss_fn) for _ in range(2)]
    assert set(calls) == {64, 32}  # the micro-batch, and its half for the fixed part

    def fastest(profs: list[Profile], b: int, attr: str) -> float:
        return min(getattr(p.blocks[b], attr) for p in profs)

    for attr in ("forward_ms", "backward_ms"):
        assert fastest(lossy, 1, attr) > 2 * fastest(plain, 1, attr), (attr, plain, lossy)
    for p, q in zip(plain, lossy):
        assert p.names == q.names
        for a, b in zip(p.blocks, q.blocks):
            assert (a.param_bytes, a.activation_bytes) == (b.param_bytes, b.activation_bytes)
        assert p.blocks[0].memory_bytes == q.blocks[0].memory_bytes
        assert q.blocks[1].memory_bytes > p.blocks[1].memory_bytes  # what the loss keeps


def test_memory_includes_what_the_loss_keeps() -> None:
    """sigmoid keeps its output (4 x 16 fp32) for backward; the mean keeps nothing. The
    block's own saved tensors are those of the test above (Linear input, tanh output)."""
    model, x = _small_chain()
    blocks = split_model(model, (x,))

    def loss_fn(outputs: tuple, n: int) -> torch.Tensor:
        return torch.sigmoid(outputs[0]).mean()

    prof = profile_blocks(blocks, (x,), warmup=0, repeats=1, loss_fn=loss_fn)
    assert [b.memory_bytes for b in prof.blocks] == [4 * (32 + 64) * 4, 4 * (64 + 16 + 16) * 4]
    # of it, the loss's own share (freed by a split backward's B): the sigmoid's output
    assert [b.loss_bytes for b in prof.blocks] == [0, 4 * 16 * 4]
    # a loss that saves only what the block already keeps (pow keeps the tanh output) adds 0
    prof = profile_blocks(blocks, (x,), warmup=0, repeats=1, loss_fn=lambda o, n: o[0].pow(2).sum())
    assert prof.blocks[1].memory_bytes == 4 * (64 + 16) * 4
    assert prof.blocks[1].loss_bytes == 0
    assert Profile.from_json(prof.to_json()) == prof  # written and read back


def test_profiling_with_a_loss_leaves_the_model_as_it_was() -> None:
    model, example = build_model("small_cnn_bn", "tiny")
    targets = torch.randint(0, 10, (example[0].shape[0],))
    blocks = split_model(model, example)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    def loss_fn(outputs: tuple, n: int) -> torch.Tensor:
        seen.append(n)
        return nn.functional.cross_entropy(outputs[0], targets[:n])

    profile_blocks(blocks, example, warmup=1, repeats=2, loss_fn=loss_fn)
    assert seen
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # batch-norm statistics restored
    assert all(p.grad is None for p in model.parameters())


def test_loss_fn_must_return_a_scalar() -> None:
    model, x = _small_chain()
    blocks = split_model(model, (x,))
    with pytest.raises(InputError, match=r"loss_fn must return a scalar tensor .* got \(4, 16\)"):
        profile_blocks(blocks, (x,), warmup=0, repeats=1, loss_fn=lambda o, n: o[0])


def test_median_profile_takes_each_time_field_blockwise() -> None:
    def prof(scale: float, mbs: int = 4) -> Profile:
        blocks = [
            BlockProfile(f"b{i}", scale * (i + 1), 2 * scale, 10, 20, 30, 0.1 * scale, 0.0)
            for i in range(3)
        ]
        return Profile("m", mbs, "cpu", blocks, "fp")

    med = median_profile([prof(1.0), prof(5.0), prof(2.0)])
    assert [b.forward_ms for b in med.blocks] == [2.0, 4.0, 6.0]
    assert [b.backward_ms for b in med.blocks] == [4.0] * 3
    assert [b.forward_fixed_ms for b in med.blocks] == [pytest.approx(0.2)] * 3
    assert (med.blocks[0].param_bytes, med.fingerprint, med.micro_batch_size) == (10, "fp", 4)
    with pytest.raises(ValueError, match="same split model"):
        median_profile([prof(1.0), prof(1.0, mbs=8)])


@pytest.mark.parametrize("in_chain", [True, False], ids=["in-chain", "isolated"])
def test_a_half_batch_probe_that_fails_prints_nothing(
        in_chain: bool, capfd: pytest.CaptureFixture[str]) -> None:
    """With as many samples as tokens the position embedding's output (tokens x width) looks
    batched, so a half-batch probe of the fixed-cost fit fails: the profile is still made,
    and the failure is not printed (an fx graph prints its code and failing line to stderr
    before it raises: a traceback on every rank of a healthy run)."""
    from lightning_autopipe.zoo.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, seq_len=4, d_model=16, n_layers=1, n_heads=2)
    tokens = torch.randint(0, 64, (4, 4))
    blocks = split_model(model, (tokens,))
    capfd.readouterr()
    prof = profile_blocks(blocks, (tokens,), repeats=1, in_chain=in_chain)
    assert capfd.readouterr().err == ""
    assert len(prof) == len(blocks)
    assert all(b.forward_ms > 0 and b.backward_ms > 0 for b in prof.blocks)


@pytest.mark.parametrize(("field", "value", "phrase"), [
    ("forward_ms", float("nan"), "forward_ms must be a number >= 0 and below 1e"),
    ("backward_ms", float("inf"), "backward_ms must be a number >= 0 and below 1e"),
    ("forward_ms", -1.0, "forward_ms must be a number >= 0 and below 1e"),
    ("param_bytes", -8, "param_bytes must be a number >= 0 and below 1e"),
    ("backward_ms", 1e308, "backward_ms must be a number >= 0 and below 1e"),
    ("forward_fixed_ms", 5.0, "forward_fixed_ms=5.0 exceeds forward_ms=1.0"),
    ("loss_bytes", 2, "loss_bytes=2 exceeds memory_bytes=1"),
])
def test_a_block_of_impossible_costs_is_refused_naming_the_field(field, value, phrase):
    """A NaN, infinite, negative or overflowing cost (1e308 ms: the plan CLI printed a step of
    inf ms and a bubble of nan%), or a fixed part above the whole, would give plans of NaN or
    negative step times (or a bare assertion deep in the planner)."""
    fields = dict(name="b0", forward_ms=1.0, backward_ms=2.0, param_bytes=1,
                  activation_bytes=1, memory_bytes=1) | {field: value}
    with pytest.raises(InputError, match=phrase):
        BlockProfile(**fields)


@pytest.mark.parametrize(("data", "phrase"), [
    ({"blocks": None}, "'blocks' must be a list of objects"),
    ({"blocks": [1]}, "'blocks' must be a list of objects"),
    ({"micro_batch_size": 2.5}, "micro_batch_size must be an integer"),
    ({"blocks": [{"name": "b", "forward_ms": "fast", "backward_ms": 1, "param_bytes": 1,
                  "activation_bytes": 1, "memory_bytes": 1}]}, "a field is not a number"),
    # a misspelt optional time would plan silently without the backward's split
    ({"blocks": [{"name": "b", "forward_ms": 1, "backward_ms": 2, "param_bytes": 1,
                  "activation_bytes": 1, "memory_bytes": 1, "backward_weigth_ms": 1}]},
     r"profile block 0 \('b'\): unknown key\(s\) \['backward_weigth_ms'\]"),
    ({"micro_batchsize": 4}, r"unknown key\(s\) \['micro_batchsize'\]"),
])
def test_a_malformed_profile_file_is_an_input_error(data, phrase):
    good = Profile("m", 4, "cpu", [BlockProfile("b", 1.0, 2.0, 1, 1, 1)]).to_dict()
    with pytest.raises(InputError, match=phrase):
        Profile.from_dict(good | data)



def test_a_head_tied_to_the_embedding_names_the_block_it_shares_with() -> None:
    """TinyGPT's head is its embedding's weight: the head's block counts it in its
    ``param_bytes`` (a stage holding the head alone holds a copy) and names the embedding's
    block and the shared bytes, which a stage holding both counts once."""
    from lightning_autopipe.planner.layout import BlockCosts
    from lightning_autopipe.zoo.tasks import build_gpt

    net = build_gpt("tied", vocab_size=64, max_seq_len=8, n_layer=1, n_embd=16)
    ids = torch.randint(0, 64, (2, 8))
    prof = profile_blocks(split_model(net, (ids,)), (ids,), warmup=0, repeats=1)
    shared = net.lm_head.weight.numel() * 4
    assert net.lm_head.weight is net.wte.weight
    assert [(b.tied_to, b.tied_bytes) for b in prof.blocks] == (
        [(-1, 0)] * (len(prof.blocks) - 1) + [(0, shared)])
    costs = BlockCosts.from_profile(Profile.from_json(prof.to_json()))
    n = len(prof.blocks)
    whole = sum(p.numel() * 4 for p in net.parameters())  # each parameter once
    assert costs.param_bytes((0, n)) == whole
    assert costs.param_bytes((0, 1), (n - 1, n)) == prof.blocks[0].param_bytes + (
        prof.blocks[-1].param_bytes - shared)  # a rank holding both ends
    assert costs.param_bytes((1, n)) == sum(b.param_bytes for b in prof.blocks[1:])


class _Thrice(torch.nn.Module):
    """One linear layer applied in three places, other layers between."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.shared(self.a(x))
        x = self.shared(self.b(x))
        return self.shared(self.c(x))


def test_a_module_applied_in_several_places_is_held_once_by_any_stage_of_its_uses() -> None:
    """Each use names the one before, so any range of blocks counts the shared layer once
    (naming the first use, a stage holding the second and third would count it twice)."""
    from lightning_autopipe.planner.layout import BlockCosts

    model, x = _Thrice(), torch.randn(2, 8)
    prof = profile_blocks(split_model(model, (x,)), (x,), warmup=0, repeats=1)
    layer = (8 * 8 + 8) * 4
    assert [(b.name, b.param_bytes) for b in prof.blocks] == [
        ("a", layer), ("shared", layer), ("b", layer), ("shared#2", layer), ("c", layer),
        ("shared#3", layer)]
    assert [(b.tied_to, b.tied_bytes) for b in prof.blocks] == [
        (-1, 0), (-1, 0), (-1, 0), (1, layer), (-1, 0), (3, layer)]
    costs = BlockCosts.from_profile(prof)
    n = len(prof.blocks)
    assert costs.param_bytes((0, n)) == 4 * layer  # each parameter once
    assert costs.param_bytes((2, n)) == 3 * layer  # b, c and the shared layer once
    assert costs.param_bytes((0, 2), (5, n)) == 2 * layer  # a rank holding a, 1st, 3rd use


@pytest.mark.parametrize("in_chain", [True, False], ids=["in-chain", "isolated"])
def test_a_model_returning_a_named_tuple_is_profiled_with_its_last_blocks_backward(
        in_chain: bool) -> None:
    """Without a loss the last block back-propagates ones from the tensors inside the model's
    own output (torch.fx keeps a named tuple's construction, as in torchvision's GoogLeNet):
    its backward runs, whole and split, and is timed, not skipped or failed on the tuple."""
    from tests.runtime._cases import build_net

    model = build_net("cnnaux")
    blocks = split_model(model, (torch.randn(4, 3, 8, 8),))
    assert blocks.tracer == "fx"
    last = profile_blocks(blocks, (torch.randn(4, 3, 8, 8),), repeats=1, in_chain=in_chain,
                          fit_fixed=False).blocks[-1]
    assert last.backward_ms > 0
    assert last.backward_input_ms is not None
    assert last.backward_input_ms > 0
    assert last.backward_weight_ms is not None
    assert last.backward_weight_ms > 0
