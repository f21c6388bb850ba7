"""The decode plan table (fastmamba/engine/plan.py): it covers every width, dtype and batch
once, its plans are what the steps are built from, and the README's batch-invariance
ranges are the table's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fastmamba.core.config import MambaConfig
from fastmamba.engine.plan import (
    ALL,
    IN_PROJ,
    LAYER_OPS,
    LAYER_OPS_DETERMINISTIC,
    MAMBA2_ROUTES,
    MANY,
    NONE,
    ROUTES,
    DecodePlan,
    batch_invariant_ranges,
    one_row_blocks,
    plan_for,
    route_for,
)

WIDTHS = (64, 768, 769, 1024, 1025, 1536, 2048, 2049, 2560, 4096)


def test_every_width_dtype_and_batch_has_exactly_one_route():
    for d in WIDTHS:
        for weights in ("16-bit", "float32"):
            for b in list(range(1, 300)) + [511, 4096, MANY]:
                hits = [r for r in ROUTES if r.weights == weights and r.widths[0] <= d <= r.widths[1]
                        and r.batches[0] <= b <= r.batches[1]]
                assert len(hits) == 1, (d, weights, b, hits)
                assert hits[0].reason


def test_plans_follow_the_table():
    cfg = MambaConfig(d_model=2560, n_layer=1, vocab_size=100)
    assert plan_for(cfg, torch.bfloat16, 2).step == "one-row"
    assert (plan_for(cfg, torch.bfloat16, 3).step, plan_for(cfg, torch.bfloat16, 3).cublas) == ("products", NONE)
    assert plan_for(cfg, torch.bfloat16, 33).cublas == IN_PROJ
    top = plan_for(cfg, torch.bfloat16, 129)
    assert top.cublas == ALL and not top.pdl  # PDL only where Triton kernels chain
    assert plan_for(cfg, torch.float32, 5).cublas == IN_PROJ and plan_for(cfg, torch.float32, 10).cublas == NONE
    for b in (1, 2, 64, 1000):
        p = plan_for(cfg, torch.float16, b, deterministic=True)
        assert (p.step, p.cublas, p.pdl) == ("products", NONE, True)
    assert route_for(768, torch.bfloat16, 4).step == "one-row" and route_for(768, torch.bfloat16, 5).step == "products"


def test_mamba2_plans_follow_their_table():
    """Mamba-2: the one-row step inside MAMBA2_ROUTES' ranges (which never overlap), the
    layer over the GPU ops elsewhere, and with float32 weights; deterministic, always the
    layer with invariant_gemm's products."""
    def m2(d):
        return MambaConfig(d_model=d, n_layer=1, vocab_size=100, d_inner=2 * d, head_dim=64, n_groups=1, layer="mamba2")

    for d in (768, 2560, 4096):
        for b in range(1, 300):
            hits = [r for r in MAMBA2_ROUTES if r.widths[0] <= d <= r.widths[1] and r.batches[0] <= b <= r.batches[1]]
            assert len(hits) <= 1 and all(r.step == "one-row" and r.reason for r in hits)
            p = plan_for(m2(d), torch.bfloat16, b)
            assert p.step == ("one-row" if hits else "layer-ops") and (p.blocks is not None) == bool(hits)
            assert plan_for(m2(d), torch.float32, b) is LAYER_OPS
            assert plan_for(m2(d), torch.bfloat16, b, deterministic=True) is LAYER_OPS_DETERMINISTIC
    assert plan_for(m2(768), torch.bfloat16, 4).step == "one-row" and plan_for(m2(768), torch.bfloat16, 5) is LAYER_OPS
    for d in (2560, 4096):
        assert plan_for(m2(d), torch.bfloat16, 1).step == "one-row" and plan_for(m2(d), torch.bfloat16, 2) is LAYER_OPS
    # Mamba-2's in_proj at 2.7b's width takes 32 rows a program; Codestral's, 130m's and
    # Mamba-1's at the same width keep 16
    rows = {(d, layer): one_row_blocks(d, 2 * d, 100, torch.bfloat16, layer).in_proj[0]
            for d in (768, 2560, 4096) for layer in ("mamba1", "mamba2")}
    assert rows == {(768, "mamba1"): 16, (768, "mamba2"): 16, (2560, "mamba1"): 16, (2560, "mamba2"): 32,
                    (4096, "mamba1"): 16, (4096, "mamba2"): 16}
    assert plan_for(m2(2560), torch.bfloat16, 1).blocks.in_proj[0] == 32


def test_hybrid_plans_follow_their_table(monkeypatch):
    """Hybrids: the one-row step where HYBRID_ROUTES (HYBRID_MOE_ROUTES with experts) has a row
    and the model's sublayers are all of its kinds, else their layers over the GPU ops;
    deterministic, always the layers with invariant_gemm's products."""
    from fastmamba.bench import HYBRID_SHAPES
    from fastmamba.engine import plan as plan_module
    from fastmamba.engine.plan import Route

    shapes = {name: MambaConfig.from_dict(HYBRID_SHAPES[name], name)
              for name in ("nemotron-h-8b", "granite-4.0-h-tiny")}
    # (the tables as they stand: batch 1 on the one-row step at every width; with experts, up to 4)
    for c in shapes.values():
        assert plan_for(c, torch.bfloat16, 1).step == "one-row"
    assert plan_for(shapes["granite-4.0-h-tiny"], torch.bfloat16, 4).step == "one-row"
    assert plan_for(shapes["nemotron-h-8b"], torch.bfloat16, 2) is LAYER_OPS
    fp8 = plan_for(shapes["nemotron-h-8b"], torch.float8_e4m3fn, 1)  # (16-bit's rows, untuned)
    assert fp8.step == "one-row" and fp8.reason.startswith("untuned: 16-bit's row")
    row = (Route("16-bit", (1, MANY), (1, 2), "one-row", NONE, "a row"),)
    monkeypatch.setattr(plan_module, "HYBRID_ROUTES", row)
    monkeypatch.setattr(plan_module, "HYBRID_MOE_ROUTES", row)
    for c in shapes.values():
        one = plan_for(c, torch.bfloat16, 2)
        assert (one.step, one.reason, one.blocks) == ("one-row", "a row", one_row_blocks(c.d_model, c.d_inner,
                                                                                         c.vocab_size, torch.bfloat16,
                                                                                         "mamba2"))
        assert plan_for(c, torch.bfloat16, 3) is LAYER_OPS and plan_for(c, torch.float32, 1) is LAYER_OPS
        assert plan_for(c, torch.bfloat16, 1, deterministic=True) is LAYER_OPS_DETERMINISTIC
    jamba_like = dataclasses.replace(shapes["nemotron-h-8b"], blocks=("mamba1", "attention", "mlp"))
    assert plan_for(jamba_like, torch.bfloat16, 1) is LAYER_OPS  # (a kind the one-row step has not)


def test_a_plan_names_known_parts_only():
    with pytest.raises(ValueError, match="step"):
        DecodePlan("gemv")
    with pytest.raises(ValueError, match="lm_heads"):
        DecodePlan("products", frozenset({"lm_heads"}))


def test_the_readme_states_the_tables_batch_invariance_ranges():
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    rows = re.findall(r"^\s*\| (\d+) \([^)]*\) \| ([^|]+) \| ([^|]+) \|$", readme, re.M)
    assert len(rows) >= 6
    for d, bf16, f32 in rows:
        for text, dtype in ((bf16, torch.bfloat16), (f32, torch.float32)):
            want = " · ".join(f"{a}-{b}" for a, b, _ in batch_invariant_ranges(int(d), dtype))
            assert text.strip() == want, (d, dtype)


def test_the_kernels_hold_no_tuned_choices():
    """The kernels' tiles and thresholds are plan.py's tables, handed to their launchers (a
    test or a sweep passes its own, never sets a module's): the upper-case names a kernel
    module assigns are constants of math or format."""
    import ast

    import fastmamba.kernels

    math_or_format = {"LOG2E", "LN2", "ARGMAX_EMPTY", "EMPTY_KEY", "LOW32", "KEY_MIN", "MAX_K", "K_ALIGN", "PRODUCTS",
                      "FIXED_SCALE", "FIXED_ONE", "FIXED_LIMIT", "NO_PDL", "INTERPRET", "ACTIVATIONS", "MMA_SCALE",
                      "ONE_ROW_KINDS", "SLOTS", "NSLOTS"}
    for path in sorted(Path(fastmamba.kernels.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        targets = [t for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        constants = {n for n in names if n.isupper() and not n.startswith("_")}
        assert constants <= math_or_format, (path.name, sorted(constants - math_or_format))


def test_a_mamba2_backbones_step_takes_its_products_where_its_table_says():
    """cuBLAS's float32 products at batch 1, invariant_gemm's at 2-256 rows (and bf16's at
    1-256), cuBLAS past the table; the deterministic mode invariant_gemm's everywhere. The
    table's rows do not overlap."""
    from fastmamba import BackboneConfig
    from fastmamba.engine.plan import BACKBONE_MAMBA2_ROUTES, backbone_step_plan

    cfg = BackboneConfig(input_dim=64, d_model=128, n_layer=3, layer="mamba2")
    for weights in ("float32", "16-bit"):
        for b in range(1, 300):
            hits = [r for r in BACKBONE_MAMBA2_ROUTES if r.weights == weights and r.batches[0] <= b <= r.batches[1]]
            assert len(hits) <= 1, (weights, b)
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 16, 256, 257, 4096):
            assert backbone_step_plan(cfg, dtype, batch, deterministic=True).cublas == NONE
            assert backbone_step_plan(cfg, dtype, batch, False).step == "layer-ops"

    def cublas(dtype, batch):
        return backbone_step_plan(cfg, dtype, batch, False).cublas

    assert cublas(torch.float32, 1) == ALL and cublas(torch.float32, 16) == NONE
    assert cublas(torch.bfloat16, 1) == NONE and cublas(torch.bfloat16, 256) == NONE
    assert backbone_step_plan(cfg, torch.float32, 257, False) is LAYER_OPS and cublas(torch.bfloat16, 4096) == ALL
