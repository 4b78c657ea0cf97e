"""split_model on real architectures: chained stages give the original outputs and gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_autopipe import split_model
from lightning_autopipe.errors import TraceError
from lightning_autopipe.zoo.models import build_model
from tests.graph._reference import call, check_split, main_output, random_cuts


def _cut_sets(n: int) -> list[list[int]]:
    """Every block its own stage, plus two seeded random partitions."""
    return [list(range(n + 1)), random_cuts(n, 3, seed=n), random_cuts(n, 5, seed=n + 1)]


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("tiny_gpt", "tiny"),
        ("small_cnn", "tiny"),
        ("small_cnn_bn", "tiny"),
        ("resnet18", "small"),
        ("resnet50", "small"),
        ("vit_b_16", "tiny"),
    ],
)
def test_fx_models_match_original(name: str, size: str) -> None:
    torch.manual_seed(0)
    model, example = build_model(name, size)
    blocks = split_model(model, example)
    assert blocks.tracer == "fx"
    assert len(blocks) >= 4
    for cuts in _cut_sets(len(blocks)):
        check_split(blocks, model, example, cuts)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_hf_models_match_original_through_export(name: str) -> None:
    torch.manual_seed(0)
    model, example = build_model(name, "tiny")  # 2 layers, d 64, vocab 256, seq 16, batch 2
    blocks = split_model(model, example)
    assert blocks.tracer == "export"
    assert blocks.dynamic_batch
    for cuts in _cut_sets(len(blocks)):
        check_split(blocks, model, example, cuts)
    # micro-batches and startup slices are smaller or larger than the traced batch
    for batch in (1, 3):
        other = {k: torch.cat([v, v])[:batch] for k, v in example.items()}
        check_split(blocks, model, other, random_cuts(len(blocks), 3, seed=batch))


class PeeksAtItsOutput(nn.Module):
    """Written for Hugging Face outputs and plain tensors alike. ``hasattr`` is true of every
    torch.fx proxy, so fx's graph reads ``.logits`` of a tensor: it fails where the model runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.relu(self.norm(self.a(x))))
        return out.logits if hasattr(out, "logits") else out


def test_an_fx_graph_that_fails_where_the_model_runs_is_captured_with_export() -> None:
    torch.manual_seed(0)
    model, example = PeeksAtItsOutput(), (torch.randn(5, 4),)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stages follow train()/eval(): nothing to warn of
        blocks = split_model(model, example)
    assert blocks.tracer == "export"
    (note,) = blocks.notes  # for the set-up log: why the model was exported
    assert "fails on example_inputs where PeeksAtItsOutput itself runs" in note
    assert note.endswith("captured with torch.export instead")
    # telling the graph's fault from the inputs' ran the model: BatchNorm's statistics are kept
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for cuts in _cut_sets(len(blocks)):
        check_split(blocks, model, example, cuts)
    _check_modes(blocks, model, example, model.norm)


def _check_modes(blocks, model: nn.Module, example, norm: nn.Module | None) -> None:
    """The stages of every cut compute what the model computes in evaluation mode, and
    BatchNorm counts batches in training only, as the model's own module does."""
    for cuts in _cut_sets(len(blocks)):
        stages = [blocks.stage(i, j) for i, j in zip(cuts, cuts[1:])]
        for stage in stages:
            stage.eval()
        model.eval()
        counted = None if norm is None else int(norm.num_batches_tracked)
        with torch.no_grad():
            torch.testing.assert_close(main_output(blocks.run(example, cuts)),
                                       main_output(call(model, example)))
        if norm is not None:
            assert int(norm.num_batches_tracked) == counted  # evaluation counts nothing
        model.train()
        for stage in stages:
            stage.train()
        blocks.run(example, cuts)
        if norm is not None:
            assert int(norm.num_batches_tracked) == counted + 1


def _bert(dropout: float) -> tuple[nn.Module, dict]:
    import transformers

    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config), {"input_ids": torch.randint(0, 64, (2, 8))}


def test_an_exported_model_with_dropout_follows_train_and_eval() -> None:
    model, example = _bert(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blocks = split_model(model, example)
    assert blocks.tracer == "export"
    _check_modes(blocks, model, example, None)
    blocks.stage(0, len(blocks)).train()  # dropout is on in training
    assert not torch.equal(main_output(blocks.run(example)), main_output(blocks.run(example)))


def test_an_exported_in_place_dropout_follows_train_and_eval() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5, inplace=True), nn.Linear(8, 2))
    example = (torch.randn(3, 4),)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blocks = split_model(model, example, tracer="export")
    _check_modes(blocks, model, example, None)
    blocks.stage(0, len(blocks)).train()
    assert not torch.equal(blocks.run(example), blocks.run(example))


class TrainsOtherwise(nn.Module):
    """A Python branch on ``self.training``: the other mode's capture is another graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.lin(x))
        return y * 2 if self.training else y


def test_an_export_the_mode_changes_otherwise_keeps_its_mode_with_a_warning() -> None:
    with pytest.warns(UserWarning, match=r"torch.export.*training-mode code of 1 node\(s\) "
                      r"\(dropout; the first in 'drop'\).*keep dropout on\. "):
        split_model(TrainsOtherwise(), (torch.randn(3, 4),), tracer="export")


def test_tied_embeddings_form_a_tie_group_across_stages() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    blocks = split_model(model, example)
    n = len(blocks)
    (tie,) = blocks.tie_groups([0, 1, n - 1, n])
    assert set(tie.aliases) == {"wte.weight", "lm_head.weight"}
    assert set(tie.stages) == {0, 2}
    # in one stage the tied weight stays one Parameter, still reported under both names
    (single,) = blocks.tie_groups([0, n])
    assert set(single.stages) == {0}
    assert set(single.stages[0]) == {"wte.weight", "lm_head.weight"}
    stage = blocks.stage(0, n)
    assert stage.get_parameter("wte.weight") is stage.get_parameter("lm_head.weight")


def test_hf_gpt2_tie_and_names() -> None:
    model, example = build_model("gpt2", "tiny")
    blocks = split_model(model, example)
    n = len(blocks)
    (tie,) = blocks.tie_groups([0, 2, n])
    assert set(tie.aliases) == {"transformer.wte.weight", "lm_head.weight"}
    assert set(tie.stages) == {0, 1}
    assert blocks.names[0] == "transformer.wte"
    assert blocks.names[-1] == "lm_head"
    assert "transformer.h.1.attn" in blocks.names
    assert "transformer.h.1.mlp" in blocks.names


def test_sub_block_is_finer_than_layer_and_cuts_are_narrow() -> None:
    model, example = build_model("gpt2", "tiny")
    layers = model.config.n_layer
    fine = split_model(model, example, granularity="sub-block")
    coarse = split_model(model, example, granularity="layer")
    assert len(fine) >= 2 * layers
    assert len(coarse) < len(fine)
    assert [f"transformer.h.{i}" for i in range(layers)] == coarse.names[1:-1]
    # a naive node-order cut carries up to 16 tensors (FACTS.md); ours carry the residual
    # stream plus the attention mask at most
    assert max(len(fine.boundary(k)) for k in range(1, len(fine))) <= 2
    for k in range(1, len(fine)):
        for v in fine.boundary(k):
            assert isinstance(v.shape, tuple)
            assert v.shape[0] == 2


def test_resnet_sub_blocks_follow_convolution_groups() -> None:
    model, example = build_model("resnet50", "small")
    fine = split_model(model, example)
    coarse = split_model(model, example, granularity="layer")
    assert coarse.names[1:-1] == [
        f"layer{s}.{b}" for s, n in zip(range(1, 5), (3, 4, 6, 3), strict=True) for b in range(n)
    ]
    assert "layer1.0.conv1" in fine.names
    assert "layer1.0.conv2" in fine.names
    assert "layer1.0.conv3" in fine.names
    assert len(fine) > 2 * len(coarse)
    assert max(len(fine.boundary(k)) for k in range(1, len(fine))) <= 2  # activation + skip


def test_run_and_stage_io_and_fingerprint() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    blocks = split_model(model, example)
    n = len(blocks)
    expected = call(model, example)
    torch.testing.assert_close(blocks.run(example, cuts=[0, 2, 5, n]), expected)
    torch.testing.assert_close(blocks.run(example), expected)
    io = blocks.stage_io(2, 4)
    assert io.blocks == (2, 4)
    assert [v.name for v in io.inputs] == list(blocks.stage(2, 4).input_names)
    assert all(v.requires_grad and v.dtype == torch.float32 for v in io.outputs)
    assert blocks.stage_io(0, 1).inputs[0].dtype == torch.int64
    assert not blocks.stage_io(0, 1).inputs[0].requires_grad
    again = split_model(build_model("tiny_gpt", "tiny")[0], example)
    assert again.fingerprint == blocks.fingerprint
    other = split_model(build_model("tiny_gpt", "small")[0], build_model("tiny_gpt", "small")[1])
    assert other.fingerprint != blocks.fingerprint
    assert split_model(model, example, granularity="layer").fingerprint != blocks.fingerprint


def test_stage_outlives_the_original_model() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    blocks = split_model(model, example)
    stage = blocks.stage(1, 3)
    inputs = blocks.stage(0, 1)(*blocks.flatten_inputs(example))
    expected = stage(*inputs)
    assert not [n for n in stage.graph.nodes if n.op == "placeholder"][len(inputs) :]
    del model, blocks
    import gc

    gc.collect()
    torch.testing.assert_close(stage(*inputs), expected)


def test_pretraced_graph_module_is_used_as_is() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    gm = torch.fx.symbolic_trace(model)
    blocks = split_model(gm, example)
    assert blocks.tracer == "graph_module"
    check_split(blocks, gm, example, random_cuts(len(blocks), 3, seed=0))
    torch.testing.assert_close(main_output(blocks.run(example)), model(*example))


def test_fx_path_accepts_other_batch_sizes_and_keyword_inputs() -> None:
    model, example = build_model("tiny_gpt", "tiny")
    blocks = split_model(model, {"input_ids": example[0]})
    ids = torch.randint(0, 128, (5, 16))
    torch.testing.assert_close(blocks.run({"input_ids": ids}, [0, 3, len(blocks)]), model(ids))
    torch.testing.assert_close(blocks.run((ids,), [0, 2, len(blocks)]), model(ids))


@pytest.mark.parametrize(("name", "size"), [("tiny_gpt", "tiny"), ("small_cnn_bn", "tiny")])
def test_export_front_end_on_fx_traceable_models(name: str, size: str) -> None:
    """The export path (aten graph, lifted parameters, symbolic batch) on models fx can also
    trace: same outputs and gradients, also at a batch size other than the traced one."""
    model, example = build_model(name, size)
    blocks = split_model(model, example, tracer="export")
    assert blocks.tracer == "export"
    n = len(blocks)
    for cuts in (list(range(n + 1)), random_cuts(n, 3, seed=0)):
        check_split(blocks, model, example, cuts)
    bigger = tuple(torch.cat([t, t[:1]]) for t in example)
    check_split(blocks, model, bigger, random_cuts(n, 3, seed=1))


def test_layer_granularity_matches_original_too() -> None:
    model, example = build_model("resnet18", "tiny")
    blocks = split_model(model, example, granularity="layer")
    assert blocks.names[1:-1] == [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    check_split(blocks, model, example, list(range(len(blocks) + 1)))


class _SharedLayer(torch.nn.Module):
    """One Linear applied twice, in different places of the chain (ALBERT-style sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.shared = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(torch.tanh(self.layers[0](x)))
        x = torch.tanh(self.layers[1](x))
        return self.layers[2](self.shared(x)) + x


def test_module_shared_across_stages_is_a_tie_group() -> None:
    torch.manual_seed(0)
    model = _SharedLayer()
    example = (torch.randn(3, 8),)
    blocks = split_model(model, example)
    n = len(blocks)
    assert n >= 4
    cuts = list(range(n + 1))
    check_split(blocks, model, example, cuts)  # gradients of both uses are summed
    shared = {t.name: set(t.stages) for t in blocks.tie_groups(cuts)}
    assert set(shared) == {"shared.weight", "shared.bias"}
    assert len(shared["shared.weight"]) == 2


def _albert(layers: int = 4, groups: int = 1) -> tuple[nn.Module, dict]:
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    model = AlbertForMaskedLM(AlbertConfig(
        vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=layers,
        num_hidden_groups=groups, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0))
    return model, {"input_ids": torch.randint(0, 64, (2, 8))}


@pytest.mark.parametrize("groups", [1, 2])
def test_each_call_of_a_layer_applied_at_every_depth_is_a_block_of_its_own(groups: int) -> None:
    """ALBERT applies one layer's weights at every depth (``groups`` layers, each applied
    ``4 / groups`` times in a row). Each call is its own layer: at ``"layer"`` granularity one
    block, at ``"sub-block"`` its attention, feed-forward and output, so a stage boundary may
    fall between the calls (the model was two blocks, embeddings to the last layer and the
    head, before), and stages holding calls of one layer hold its weights as a tie group whose
    gradients sum to the model's."""
    model, example = _albert(groups=groups)
    layer = split_model(model, example, granularity="layer")
    assert layer.tracer == "export"
    group = "albert.encoder.albert_layer_groups"
    assert [n.split("#")[0] for n in layer.names if group in n] == [
        f"{group}.{g}" for g in range(groups) for _ in range(4 // groups)]
    blocks = split_model(model, example)
    calls = [n.split("#")[0].rsplit(".", 1)[-1] for n in blocks.names if group in n]
    assert calls == ["attention", "ffn", "ffn_output"] * 4
    n = len(blocks)
    between = blocks.names.index(f"{group}.0.albert_layers.0.attention#2")  # the 2nd call
    for cuts in (list(range(n + 1)), random_cuts(n, 3, seed=n), [0, between, n]):
        check_split(blocks, model, example, cuts)  # the ties' gradients sum to the model's
    ties = {t.name: set(t.stages) for t in blocks.tie_groups([0, between, n])}
    assert ties[f"{group}.0.albert_layers.0.attention.query.weight"] == {0, 1}
    layer_cuts = [0, len(layer) // 2, len(layer)]
    check_split(layer, model, example, layer_cuts)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Encoder(nn.Module):
    """Attention and an MLP, each followed by a norm: one norm applied twice (``shared``) or
    two norms."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.attn = _Attention()
        self.mlp = _Mlp()
        self.norm = nn.LayerNorm(16)
        self.norm2 = self.norm if shared else nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class _Encoded(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.emb, self.enc, self.head = nn.Linear(8, 16), _Encoder(shared), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)))


def test_a_small_module_applied_in_two_places_splits_like_two_modules() -> None:
    """Only a module applied several times that holds a layer's share of the weights becomes
    per-call layers: a norm applied twice leaves the layers around it as two norms do (taken
    for layers, it broke the encoder into its projections, with cuts between q, k and v)."""
    example = (torch.randn(2, 5, 8),)
    names = []
    for shared in (False, True):
        torch.manual_seed(0)
        model = _Encoded(shared)
        blocks = split_model(model, example)
        check_split(blocks, model, example, list(range(len(blocks) + 1)))
        names.append([n.split("#")[0].replace("norm2", "norm") for n in blocks.names])
    assert names[1] == names[0]
    assert "enc.attn" in names[0]


def test_a_language_model_that_returns_its_key_value_cache_is_captured_without_it() -> None:
    """Hugging Face causal LMs built from a default config (``use_cache=True``) return a
    key/value cache object that torch.export cannot return: such a model used to be refused
    with the fix (``use_cache=False``), which DDP never asks for. It is captured with the cache
    off (training never reads it), says so, and leaves the model's config as it was."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=16))
    assert model.config.use_cache
    example = {"input_ids": torch.randint(0, 64, (2, 8))}
    blocks = split_model(model, example)
    assert model.config.use_cache
    assert any("use_cache=False" in note for note in blocks.notes), blocks.notes
    n = len(blocks)
    for cuts in (list(range(n + 1)), random_cuts(n, 3, seed=n)):
        check_split(blocks, model, example, cuts)


def test_export_from_a_single_sample_still_has_a_dynamic_batch() -> None:
    """A batch-1 example would be specialised by torch.export (0/1 specialisation); the
    tracer exports on a doubled batch so later micro-batches of any size still run."""
    model, example = build_model("gpt2", "tiny", batch_size=1)
    blocks = split_model(model, example)
    assert blocks.dynamic_batch
    ids = torch.randint(0, 256, (3, 16))
    out = blocks.run({"input_ids": ids}, [0, 2, len(blocks)])
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits)


class _Recurrent(nn.Module):
    """No repeated layers: embedding, a 2-layer LSTM, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(ids))
        return self.head(out[:, -1])


class _Wrapped(nn.Module):
    """How a LightningModule holds a model (``self.net``), wrapped twice."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.ModuleDict({"inner": _Recurrent()})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net["inner"](ids) * 1.0


@pytest.mark.parametrize("granularity", ["sub-block", "layer"])
def test_a_wrapped_model_splits_like_the_model(granularity: str) -> None:
    torch.manual_seed(0)
    example = (torch.randint(0, 50, (4, 6)),)
    plain = split_model(_Recurrent(), example, granularity=granularity)
    model = _Wrapped()
    wrapped = split_model(model, example, granularity=granularity)
    assert plain.names == ["emb", "lstm", "head"]
    assert wrapped.names == [f"net.inner.{n}" for n in plain.names]
    for cuts in _cut_sets(len(wrapped)):
        check_split(wrapped, model, example, cuts)


def test_a_parameter_read_only_by_an_output_belongs_to_the_last_block():
    """``self.scale * 2`` reads no input: the last stage computes it from ``scale``, which is
    then no orphan (a tensor no block reads, kept by the first stage)."""

    class ScaleOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))), self.scale * 2

    model, x = ScaleOut(), (torch.randn(2, 4),)
    blocks = split_model(model, x)
    assert blocks.orphans == {}
    last = blocks.stage(len(blocks) - 1, len(blocks))
    assert "scale" in last.param_names.values()


def test_the_last_stage_holds_what_no_block_reads_under_its_names():
    """A head kept for later (nested), a second name of it, a frozen parameter and a buffer
    the forward never reads: the last stage holds them under their original names, the
    same objects as the model's, also when rebuilt after ``keep_stages``; no other stage
    does, and every stage's names together are the model's ``state_dict``."""

    class Spare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.head = nn.Sequential(nn.Linear(4, 2))
            self.alias = self.head[0]  # a second name of the same weights
            self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
            self.register_buffer("version", torch.tensor(3))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = Spare()
    blocks = split_model(model, (torch.randn(2, 4),))
    n = len(blocks)
    assert sorted(blocks.orphans) == ["frozen", "head.0.bias", "head.0.weight", "version"]
    original = model.state_dict(keep_vars=True)
    for _ in range(2):
        last = blocks.stage(n - 1, n)
        held = last.state_dict(keep_vars=True)
        for name in blocks.orphans:
            local = next(k for k, v in last.param_names.items() if v == name)
            assert held[local] is original[name]
        assert not set(blocks.orphans) & set(blocks.stage(0, n - 1).param_names.values())
        names = set(blocks.stage(0, n - 1).param_names.values()) | set(last.param_names.values())
        assert names | {"alias.weight", "alias.bias"} == set(original)
        blocks.keep_stages([])  # built again next round


class _CheckpointedStack(nn.Module):
    """Layers run under the reentrant ``torch.utils.checkpoint``, as fine-tuning code asks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=True)
        return self.out(h)


@pytest.mark.parametrize("name", ["torch", "gpt2"])
def test_reentrant_activation_checkpointing_is_captured_with_its_gradients(name: str) -> None:
    """Traced as it runs, a reentrant checkpoint's forward computes without gradients (its
    layers' weights would never learn, or the backward fails); the split model's gradients
    equal the model's own, which recomputes those layers in its backward, and a warning says
    what was met."""
    torch.manual_seed(0)
    if name == "torch":
        model, example = _CheckpointedStack(), (torch.randn(4, 6),)
    else:
        model, example = build_model("gpt2", "tiny")
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    with pytest.warns(UserWarning, match=r"checkpoint\(use_reentrant=True\)"):
        blocks = split_model(model, example)
    for cuts in _cut_sets(len(blocks)):
        check_split(blocks, model, example, cuts)
    assert "apply" not in vars(torch.utils.checkpoint.CheckpointFunction)  # restored


class _StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient through unchanged (quantisation-aware training)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ReverseGradient(torch.autograd.Function):
    """The identity in forward, the gradient scaled by -0.5 in backward (domain adaptation)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class _OwnFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _StraightThrough.apply(torch.tanh(self.a(x)))
        h = _ReverseGradient.apply(torch.tanh(self.b(h)))
        return self.c(h)


def test_a_models_own_autograd_functions_keep_their_backward() -> None:
    """torch.fx keeps each call as one node, so the split model's gradients are the model's
    (traced as it runs, the rounding's zero gradient and the identity's would be used); a
    torch.export capture cannot keep them and is refused naming them and the fixes."""
    torch.manual_seed(0)
    model, example = _OwnFunctions(), (torch.randn(4, 6),)
    blocks = split_model(model, example)
    assert blocks.tracer == "fx"
    for cuts in _cut_sets(len(blocks)):
        check_split(blocks, model, example, cuts)
    with pytest.raises(TraceError, match=r"_StraightThrough, .*_ReverseGradient\).*torch\.fx.*"
                                         r"register_autograd"):
        split_model(model, example, tracer="export")
    with torch.device("meta"):
        unbuilt = _OwnFunctions()
    notes = split_model(unbuilt, example, tracer="export").notes
    assert any("on the meta device the split model's gradients cannot be checked" in note
               for note in notes), notes
    assert vars(torch.autograd.Function)["apply"] is _FUNCTION_APPLY  # restored


_FUNCTION_APPLY = vars(torch.autograd.Function)["apply"]


class _Tanh(torch.autograd.Function):
    """A function whose backward is the gradient of its forward (a hand-written fused op)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.tanh(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out * out)


class _ExactFunction(_OwnFunctions):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(_Tanh.apply(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_own_function_whose_backward_is_its_forwards_gradient_is_exported(dtype) -> None:
    """What torch.export's graph computes is then what the model trains with: it is kept,
    in bfloat16 too (whose rounding in another order moves gradients by a few percent)."""
    torch.manual_seed(0)
    model, example = _ExactFunction().to(dtype), (torch.randn(4, 6, dtype=dtype),)
    blocks = split_model(model, example, tracer="export")
    if dtype == torch.float32:
        for cuts in _cut_sets(len(blocks)):
            check_split(blocks, model, example, cuts)


class _TakesAnyArguments(nn.Module):
    """A wrapper whose forward passes on whatever it gets (``forward(self, *args)``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args).logits


class _TakesMoreArguments(_TakesAnyArguments):
    """``*rest`` after a named input, given none here."""

    def forward(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.model(ids, *rest).logits


@pytest.mark.parametrize("wrap", [_TakesAnyArguments, _TakesMoreArguments])
def test_a_forward_taking_star_args_is_exported_with_a_dynamic_batch(wrap) -> None:
    """torch.export matches the batch dimension's specs to forward's parameters: the inputs
    of ``*args`` are one tuple there (and a ``*rest`` given none has no spec). Given flat, the
    dynamic export failed and the static one fixed the batch, so micro-batches of another size
    failed in the stage."""
    torch.manual_seed(0)
    model, example = build_model("gpt2", "tiny")
    wrapper = wrap(model)
    ids = example["input_ids"]
    blocks = split_model(wrapper, (ids,))
    assert blocks.tracer == "export"
    assert blocks.dynamic_batch
    assert not any("exported statically" in note for note in blocks.notes), blocks.notes
    for batch in (1, 3):
        check_split(blocks, wrapper, (torch.cat([ids, ids])[:batch],),
                    random_cuts(len(blocks), 3, seed=batch))
