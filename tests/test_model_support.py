"""Which models the pipeline takes: unsupported ones refused at construction with an error that
says why and what is supported, on every rank, before any step; supported heads beyond causal LMs
(sequence classification with a ``loss_fn``, a plain ``nn.Sequential``) equal to one process."""

from __future__ import annotations

import copy

import pytest
import torch
from models import VOCAB, llama, make_batch
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForSequenceClassification
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import pippy_xla as px
from pippy_xla.testing import run_ranks

GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _seqcls():
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        num_labels=3,
    )
    return LlamaForSequenceClassification(cfg)


def _bert():
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
    )
    return BertModel(cfg)


def _refusals(rank, world):
    out = {}
    cases = {
        "bert": (_bert, BertLayer),
        "seqcls_own_loss": (_seqcls, LlamaDecoderLayer),
        "layer_cls_linear": (lambda: llama()[0], nn.Linear),
    }
    for name, (make, layer_cls) in cases.items():
        with pytest.raises(px.UnsupportedModelError) as e:
            px.PipelineModel(make(), layer_cls=layer_cls, num_microbatches=2, timeout=20)
        out[name] = str(e.value)
    return out


def test_unsupported_models_are_refused_at_construction():
    out = run_ranks(2, _refusals)
    assert out[0] == out[1]  # the same refusal on every rank
    why = out[0]
    # The model's own line that the tracer could not run, and what is supported.
    assert "cannot trace BertModel into a pipeline: TypeError" in why["bert"]
    assert "modeling_bert.py:" in why["bert"] and "position_ids" in why["bert"]
    assert "HF decoder-only causal LMs" in why["bert"]
    assert "needs ['pooled_logits', 'config']" in why["seqcls_own_loss"]
    assert "pass loss_fn=" in why["seqcls_own_loss"]
    assert "are not the entries of one nn.ModuleList" in why["layer_cls_linear"]
    assert "Classes found in its ModuleLists: ['LlamaDecoderLayer']" in why["layer_cls_linear"]


def _sum_ce(logits, labels, num_items):
    return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum") / (
        num_items
    )


def _count(labels):
    return torch.tensor(labels.numel())


def _sequence_classification(rank, world):
    torch.manual_seed(0)
    model = _seqcls()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(
        model,
        layer_cls=LlamaDecoderLayer,
        num_microbatches=2,
        loss_fn=_sum_ce,
        num_items_fn=_count,
        timeout=30,
    )
    batch = make_batch(seed=1)  # right-padded rows: pooled at each row's last real token
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    batch["labels"] = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2))
    loss = pipe.run_train(**batch)
    logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref_loss = _sum_ce(logits, batch["labels"], _count(batch["labels"]))
    ref_loss.backward()
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    n = 0
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
        n += 1
    assert n > 0
    return float(loss)


def test_sequence_classification_with_a_loss_fn_equals_one_process():
    out = run_ranks(2, _sequence_classification)
    assert out[0] == out[1]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return x + nn.functional.gelu(self.fc(x))


class _Tokens(nn.Module):
    """Not an HF model: a plain module whose output is the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input):  # noqa: A002  (the name a plain module takes)
        x = self.emb(input)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _plain_module(rank, world):
    torch.manual_seed(0)
    model = _Tokens()
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(
        model,
        layer_cls=_Block,
        num_microbatches=2,
        input_names=("input",),
        loss_fn=_sum_ce,
        num_items_fn=_count,
        timeout=30,
    )
    ids = make_batch(seed=1)["input_ids"]
    loss = pipe.run_train(input=ids, labels=ids)
    ref_loss = _sum_ce(ref(ids), ids, _count(ids))
    ref_loss.backward()
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
    return [n for n, _ in pipe.named_parameters()]


def test_a_plain_module_with_a_loss_fn_equals_one_process():
    names = run_ranks(2, _plain_module)
    assert names[0][0].startswith("emb.") and names[1][-1].startswith("head.")


def _rows(labels):
    return torch.tensor(labels.shape[0])


def _squares(out, labels, num_items):
    return (out - labels).square().sum() / num_items


def _regression(rank, world):
    # Not a causal LM: its count (rows) is named; the causal-LM count (tokens after a shift) would
    # scale the loss by rows / (rows - 1) per column, silently.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *(_Block() for _ in range(4)), nn.Linear(32, 1))
    ref = copy.deepcopy(model)
    pipe = px.PipelineModel(
        model,
        layer_cls=_Block,
        num_microbatches=2,
        input_names=("input",),
        loss_fn=_squares,
        num_items_fn=_rows,
        timeout=30,
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 1, generator=g)
    loss = pipe.run_train(input=x, labels=y)
    ref_loss = _squares(ref(x), y, _rows(y))
    ref_loss.backward()
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **GRAD_TOL, msg=name)
    return float(loss)


def test_a_regression_with_its_own_count_equals_one_process():
    out = run_ranks(2, _regression)
    assert out[0] == out[1]
