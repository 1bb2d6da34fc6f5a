"""NF4 evaluation on bitsandbytes' CUDA backend, the same checks as its CPU backend's
(tests/evaluation/test_evaluation.py). ``gpu``-marked: collected on CPU, where it is skipped."""

from __future__ import annotations

import pytest

from tests.evaluation.test_evaluation import SHAPES as QUANTISED_SHAPES, check_quantised_ppl

pytestmark = pytest.mark.gpu



@pytest.mark.parametrize("shape", QUANTISED_SHAPES)
def test_nf4_evaluation(tmp_path, shape):
    pytest.importorskip("bitsandbytes")
    check_quantised_ppl(tmp_path, "cuda", shape)
