"""The loader packs linear weights for oneDNN only when timing both on this machine says
packing is faster (kernels/cpu_linear.py ``measure_packing``), and logs the timings."""

from __future__ import annotations

import logging

import pytest
import torch

from cluster.tools.make_model import make_model
from kernels import cpu_linear
from workers.models import load_model

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("choice") / "m", "llama", "tiny")


@needs_onednn
@pytest.mark.parametrize("packed_wins", [True, False])
def test_the_measured_winner_is_loaded(model_dir, monkeypatch, caplog, packed_wins):
    measured = []

    def measure(weight, rows=32, repeats=7):
        measured.append(tuple(weight.shape))
        fast, slow = (1e-6, 1e-5), (2e-6, 2e-5)
        return cpu_linear.PackingChoice(rows, slow if packed_wins else fast,
                                        fast if packed_wins else slow)  # fmt: skip

    monkeypatch.setattr(cpu_linear, "measure_packing", measure)
    with caplog.at_level(logging.INFO, logger="workers.models.loader"):
        model, _ = load_model(model_dir, torch.float32, CPU)
    # Timed once, on the largest decoder-layer weight (gate_up: 2 x 128 by 64).
    assert measured == [(256, 64)]
    layers = model.model.layers
    weights = [layers[0].self_attn.qkv_proj.weight, layers[1].mlp.down_proj.weight,
               model.lm_head.weight]  # fmt: skip
    assert all(w.is_mkldnn is packed_wins for w in weights)
    assert ("packed for oneDNN" if packed_wins else "kept for F.linear") in caplog.text
    assert "measured F.linear" in caplog.text


@needs_onednn
def test_both_choices_compute_the_same_logits(model_dir, monkeypatch):
    """Packing is a speed choice only: the model's output is the same to float tolerance."""
    ids = torch.arange(1, 9)
    outs = []
    for packed_wins in (True, False):
        plain, packed = ((2e-6, 2e-5), (1e-6, 1e-5))[:: 1 if packed_wins else -1]
        monkeypatch.setattr(cpu_linear, "measure_packing",
                            lambda w, rows=32, repeats=7, p=plain, q=packed:
                            cpu_linear.PackingChoice(rows, p, q))  # fmt: skip
        model, _ = load_model(model_dir, torch.float32, CPU)
        with torch.inference_mode():
            outs.append(model.compute_logits(model.model.embed_tokens(ids)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
