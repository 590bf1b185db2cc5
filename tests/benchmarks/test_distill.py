"""The distillation loss with a cut head (benchmarks/reference_pair/distill.py).

The draft is trained for the softmax it runs with draft_head_tokens: target tokens outside
the head fall into the "rest" bucket. With every token in the head, the loss must be the
full-vocabulary loss; with a cut head, tokens outside it must never be predicted.
"""
import pytest
import torch

from benchmarks.reference_pair.distill import Head, export, forward_loss, frequency_order, init_from

VOCAB = 64


@pytest.fixture(scope="module")
def draft():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def sequences(n=3, gen=6, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        top = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(gen)])
        lp = torch.log_softmax(torch.randn(gen, k + 2, generator=g), -1)[:, :k]  # some rest mass
        out.append({"prompt_ids": torch.randint(0, VOCAB, (5,), generator=g, dtype=torch.int32),
                    "gen_ids": top[:, 0].int(), "top_ids": top.int(),
                    "top_lp": lp.sort(-1, descending=True).values.half()})
    return out


def test_head_maps_ids_and_drops_the_rest():
    head = Head([5, 3, 9, 1], 3, VOCAB)
    assert head.ids.tolist() == [3, 5, 9]
    assert head.index_of(torch.tensor([9, 3, 1, -1, 5])).tolist() == [2, 0, -1, -1, 1]


def test_frequency_order_counts_prompts_and_generations():
    seqs = [{"prompt_ids": torch.tensor([7, 7, 2]), "gen_ids": torch.tensor([2, 7, 4])}]
    assert frequency_order(seqs, 10)[:3] == [7, 2, 4]


def test_full_head_equals_no_head(draft):
    group = sequences()
    kl, agree, _, n = forward_loss(draft, group, 384, 0, 0.0)
    kl_h, agree_h, _, n_h = forward_loss(draft, group, 384, 0, 0.0, Head(list(range(VOCAB)), VOCAB, VOCAB))
    assert n == n_h == 18
    assert torch.allclose(kl, kl_h, atol=1e-5) and agree == agree_h


def test_cut_head_loss_is_finite_and_predicts_inside_it(draft):
    group = sequences()
    head = Head(list(range(0, VOCAB, 2)), VOCAB // 2, VOCAB)  # even ids only
    kl, _, _, _ = forward_loss(draft, group, 384, 0, 0.0, head)
    assert torch.isfinite(kl) and kl > 0
    # make every position's top token an odd id: outside the head, so never agreed with
    for s in group:
        s["top_ids"][:, 0] = 1
    _, agree, _, _ = forward_loss(draft, group, 384, 0, 0.0, head)
    assert agree == 0.0
    kl.backward()  # the cut-head loss trains the layers
    assert draft.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize("compress", [False, True])
def test_init_from_an_export_continues_the_same_weights(draft, tmp_path, compress):
    """--init: a second round of training starts from the exported draft, not from target layers."""
    from transformers import LlamaForCausalLM

    export(draft, tmp_path, order=list(range(VOCAB)), compress=not compress)
    export(draft, tmp_path, order=list(range(VOCAB)), compress=compress)  # replaces the other form
    assert sorted(p.name for p in tmp_path.glob("draft_delta*")) == (
        ["draft_delta.safetensors.xz"] if compress else ["draft_delta.safetensors"])
    stale = tmp_path / ("draft_delta.safetensors" if compress else "draft_delta.safetensors.xz")
    stale.write_bytes(b"old")
    with pytest.raises(FileExistsError, match="remove the stale one"):  # never guess which one is meant
        init_from(LlamaForCausalLM(draft.config), tmp_path)
    stale.unlink()
    fresh = LlamaForCausalLM(draft.config).eval()
    fresh.model.embed_tokens.weight.data.copy_(draft.model.embed_tokens.weight)  # the build's job
    init_from(fresh, tmp_path)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():  # the export is bf16: equal up to its rounding
        assert torch.allclose(fresh(ids).logits, draft(ids).logits, atol=0.1)
        assert fresh(ids).logits.argmax(-1).tolist() == draft(ids).logits.argmax(-1).tolist()
    other = LlamaForCausalLM(draft.config.__class__(**{**draft.config.to_dict(), "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="does not fit"):
        init_from(other, tmp_path)


@pytest.mark.parametrize("position", [0, 1])
def test_grow_inserts_a_layer_that_changes_nothing_yet(draft, tmp_path, position):
    """--grow: a deeper draft starts from the smaller one's predictions, and the new layer trains."""
    from transformers import LlamaForCausalLM

    export(draft, tmp_path, order=list(range(VOCAB)))
    deeper = LlamaForCausalLM(draft.config.__class__(**{**draft.config.to_dict(), "num_hidden_layers": 2})).eval()
    deeper.model.embed_tokens.weight.data.copy_(draft.model.embed_tokens.weight)
    init_from(deeper, tmp_path, new_layers=(position,))
    same = LlamaForCausalLM(draft.config).eval()  # the smaller draft as exported (bf16-rounded)
    same.model.embed_tokens.weight.data.copy_(draft.model.embed_tokens.weight)
    init_from(same, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.allclose(deeper(ids).logits, same(ids).logits, atol=1e-6)
    kl, _, _, _ = forward_loss(deeper, sequences(), 384, 0, 0.0)
    kl.backward()
    new = deeper.model.layers[position]
    assert new.mlp.down_proj.weight.grad.abs().sum() > 0 and new.self_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="does not fit"):  # two new layers leave no place for the delta's one
        init_from(deeper, tmp_path, new_layers=(0, 1))


def test_the_committed_delta_stays_small_and_loads():
    """The issue's bound for what a fresh clone carries: well under 50 MB."""
    import json

    from benchmarks.reference_pair.build import DELTA_FILE, DRAFT_CONFIG_FILE, HERE, load_delta

    assert DELTA_FILE.stat().st_size < 40e6
    layers = json.loads(DRAFT_CONFIG_FILE.read_text())["num_hidden_layers"]
    keys = load_delta(HERE).keys()
    assert {k.split(".")[2] for k in keys if k.startswith("model.layers.")} == {str(i) for i in range(layers)}
