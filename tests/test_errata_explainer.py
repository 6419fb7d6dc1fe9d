"""The explainer on feature maps and decoding: its chunked module's two normalisers, its decoding order, its
citation of the elu + 1 map. Each literal form is checked to be wrong where it is, and right where it should be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_edu import errata, hybrid_attention, normalized_attention, normalized_attention_step
from lightning_edu import feature_maps as fm
from lightning_edu import numpy_reference as nr


def head(n, d=6, d_v=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((n, d_v))


def test_separate_normalisers_make_rows_sum_to_two_past_the_first_chunk():
    ev = errata.explainer_hybrid_evidence()
    assert ev["first_chunk_row_sums"] == pytest.approx((1.0, 1.0), abs=1e-14)
    assert ev["later_row_sums"] == pytest.approx((2.0, 2.0), abs=1e-14)
    assert ev["joint_row_sums"] == pytest.approx((1.0, 1.0), abs=1e-14)
    assert ev["weights_match"] < 1e-14  # the package's "hybrid_separate" weights are the module's
    assert ev["rel_error_vs_joint"] > 0.3


def test_explainers_module_literal_against_the_package():
    q, k, v = head(29)
    phi = errata.explainer_feature_map(errata.explainer_feature_weights(6))
    # one chunk: no inter part, so the module is causal softmax, like the joint form
    one = errata.explainer_hybrid_separate(q, k, v, chunk_size=32, feature_map=phi)
    softmax = nr.softmax_attention(q[None, None], k[None, None], v[None, None], causal=True)[0, 0]
    assert np.abs(one - softmax).max() < 1e-14
    # several chunks: the module is the sum of the two separately normalised parts, the weights say so
    W = fm.attention_weights(q, k, "hybrid_separate", feature_map=phi, block_size=8)
    assert np.abs(errata.explainer_hybrid_separate(q, k, v, 8, phi) - W @ v).max() < 1e-13
    joint = hybrid_attention(q[None, None], k[None, None], v[None, None], block_size=8, feature_map=phi)[0, 0]
    assert np.abs(joint - fm.attention_weights(q, k, "hybrid", feature_map=phi, block_size=8) @ v).max() < 1e-13
    assert np.linalg.norm(joint[:8] - W[:8] @ v) < 1e-13  # the first chunk agrees ...
    assert np.linalg.norm(joint[8:] - W[8:] @ v) > 0.3 * np.linalg.norm(joint[8:])  # ... the rest does not


def test_default_feature_map_is_the_explainers_with_its_floor():
    x = np.random.default_rng(1).standard_normal((5, 6))
    W = errata.explainer_feature_weights(6, 3, seed=2)
    assert W.shape == (6, 3) and 0.05 < W.std() < 0.2
    phi = errata.explainer_feature_map(W)(x)
    assert np.allclose(phi, np.maximum(x @ W, 0) ** 2 + 1e-6, rtol=0, atol=0) and phi.min() >= 1e-6


def test_decoding_reads_the_state_before_the_token_enters_it():
    ev = errata.explainer_decode_evidence()
    assert ev["corrected"] < 1e-12 and ev["printed"] > 0.1
    assert ev["first_output_printed"] == 0.0 and ev["first_output_true"] > 0
    # the corrected loop is normalized_attention_step, token by token
    q, k, v = head(9)
    phi = fm.ReLU2Projection(np.random.default_rng(3).standard_normal((6, 5)))
    state, outs = None, []
    for t in range(9):
        o, state = normalized_attention_step(q[None, None, t], k[None, None, t], v[None, None, t], state, feature_map=phi)
        outs.append(o[0, 0])
    assert np.abs(np.stack(outs) - errata.explainer_decode(q, k, v, phi, "corrected")).max() < 1e-13
    whole = normalized_attention(q[None, None], k[None, None], v[None, None], feature_map=phi)[0, 0]
    assert np.abs(np.stack(outs) - whole).max() < 1e-13
    with pytest.raises(ValueError, match="order must be one of"):
        errata.explainer_decode(q, k, v, phi, "before")


def test_katformer_citation_and_the_map_it_stands_for():
    cite = errata.KATFORMER
    assert cite.printed == "Katformer, 2020"
    assert "Katharopoulos" in cite.correct and "Transformers are RNNs" in cite.correct and "2006.16236" in cite.correct
    check = cite.check()
    assert check["max_abs_diff_vs_formula"] == 0.0
    # torch forms elu with expm1, numpy's map with exp: a few roundings apart (each library's vector exp differs by
    # CPU), far below anything that would tell two maps apart
    assert check["max_abs_diff_vs_torch"] < 1e-15
    assert check["min_on_grid"] > 0
    assert check["underflow"][0] > 0 and check["underflow"][1] == 0.0
    x = torch.linspace(-5, 5, 11, dtype=torch.float64)
    assert torch.equal(fm.TORCH_FEATURE_MAPS["elu+1"](x), torch.nn.functional.elu(x) + 1)


def test_explainer_errata_list():
    keys = [e.key for e in errata.EXPLAINER_ERRATA]
    assert keys == ["hybrid_separate_normalisers", "decode_query_before_update", "katformer_citation"]
    for e in errata.EXPLAINER_ERRATA:
        assert e.printed and e.corrected_text and isinstance(e.evidence(), dict)
    assert errata.ERRATA[-1].key == "la3_dkv_order"  # the paper's list is unchanged: these are not gradients
