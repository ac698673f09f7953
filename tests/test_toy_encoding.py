"""Adding an encoding is one source file and one test file: a toy encoding defined here, registered with
``register_pe``, goes through the generic encoding contract, a ViT forward and backward, folding and one bench
row, with nothing else in the package changed."""

import pytest
import torch
from torch import Tensor, nn

import test_enc_api_contract as contract
import test_encodings as generic
from ropekit.bench import BenchConfig, run_bench
from ropekit.encodings import PAPER_PRESETS, PE_REGISTRY, BenchRow, create_pe, list_pes, register_pe
from ropekit.encodings.ops.frequencies import axial_frequencies
from ropekit.encodings.rope import FrequencyRoPE
from ropekit_studies.report import pe_label
from ropekit.fold import fold, foldable_kind, to_rope
from ropekit.nn import PAPER_SHARING, VisionTransformer, vit_config


class ToyRoPE(FrequencyRoPE):
    """Axial RoPE frequencies times one learnable scale (per parameter head): ``freqs = s * axial``."""

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, *, init_scale: float = 1.0,
                 per_head: bool = False) -> None:
        super().__init__(head_dim, coord_dim, num_heads, per_head=per_head)
        self.init_scale = init_scale
        self.register_buffer("axial", axial_frequencies(head_dim, coord_dim).unsqueeze(0), persistent=False)
        self.scale = nn.Parameter(torch.empty(self.param_heads, 1, 1))
        self._init_weights()

    def _init_weights(self) -> None:
        if not self.scale.is_meta:
            with torch.no_grad():
                self.scale.fill_(self.init_scale)

    @property
    def freqs(self) -> Tensor:  # (Hp, c, d/2)
        return self.scale * self.axial


TOY_ROWS = (BenchRow("toy"), BenchRow("folded toy", kind="folded", base="toy"),
            BenchRow("toy in training", kind="train", base="toy"))


@pytest.fixture(autouse=True, scope="module")
def registered():
    """``ToyRoPE`` registered as ``"toy"`` for this module's tests only (the other modules see the built-in list)."""
    register_pe("toy", label="Toy RoPE", paper_preset={"init_scale": 0.5}, paper_sharing="layer",
                bench_rows=TOY_ROWS)(ToyRoPE)
    yield
    PE_REGISTRY.pop("toy")


def test_registration_declares_everything_on_the_class():
    assert "toy" in list_pes() and ToyRoPE.name == "toy"
    assert PAPER_PRESETS["toy"] == {"init_scale": 0.5} and PAPER_SHARING["toy"] == "layer"
    assert pe_label("toy") == "Toy RoPE"
    assert create_pe("toy", head_dim=8, coord_dim=2, preset="paper").scale.item() == 0.5
    assert create_pe("toy", head_dim=8, coord_dim=2, preset="paper", init_scale=2.0).scale.item() == 2.0
    assert foldable_kind(create_pe("toy", head_dim=8, coord_dim=2)) == "rope"
    with pytest.raises(ValueError, match="already registered"):
        register_pe("toy")(type("Other", (ToyRoPE,), {}))


def test_an_encoding_put_in_the_registry_directly_takes_the_paper_preset():
    PE_REGISTRY["toy-plain"] = type("PlainToy", (ToyRoPE,), {})
    try:
        assert create_pe("toy-plain", head_dim=8, coord_dim=2, preset="paper").scale.item() == 0.5
    finally:
        PE_REGISTRY.pop("toy-plain")


@pytest.mark.parametrize("check", [contract.test_prepare_apply_equals_forward,
                                   contract.test_k_coords_encode_keys_at_their_own_positions,
                                   contract.test_grouped_keys_with_shared_parameters, contract.test_bnhd_layout,
                                   contract.test_half_pairs_are_a_relabelling, generic.test_prefix_tokens_untouched,
                                   generic.test_same_seed_same_output,
                                   generic.test_state_dict_holds_only_learnable_parameters],
                         ids=lambda f: f.__name__)
def test_generic_contract(check):
    check("toy")


@pytest.mark.parametrize("zero_init", [False, True])
def test_every_parameter_gets_a_finite_gradient(zero_init):
    generic.test_every_parameter_gets_finite_gradient("toy", zero_init)


def test_to_rope_is_the_encoding_itself():
    pe = create_pe("toy", head_dim=8, coord_dim=2, num_heads=2, init_scale=0.7).double()
    p, freqs = to_rope(pe)
    assert torch.equal(p, torch.eye(8, dtype=torch.float64).expand(2, 8, 8))
    torch.testing.assert_close(freqs, (0.7 * pe.axial).expand(2, -1, -1))


def _model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(vit_config("tiny", num_classes=3, in_chans=1, image_size=(8, 8), patch_size=4,
                                        embed_dim=16, depth=2, num_heads=2, pe="toy"))


def test_vit_forward_backward_and_folding():
    model = _model()
    assert model.cfg.resolved().pe_sharing == "layer"  # the paper sharing declared on the class
    x = torch.randn(2, 1, 8, 8)
    logits = model(x)
    logits.square().sum().backward()
    scales = [p for n, p in model.named_parameters() if n.endswith(".scale")]
    assert len(scales) == 2 and all(p.grad is not None and p.grad.abs().sum() > 0 for p in scales)
    model.eval()
    folded = fold(model)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


def test_one_bench_row():
    cfg = BenchConfig(batch=1, heads=2, head_dim=8, grid=3, cases=("grid2d",), rows=("toy",), repeats=1, warmup=0,
                      threads=1, row_budget_s=0.01, memory=False, vit=(), timm=False,
                      max_spread=None)  # microsecond calls on a loaded machine: noise must not refuse the row
    records = run_bench(cfg, log=lambda _: None)
    assert {r["label"] for r in records} == {row.label for row in TOY_ROWS}
    assert all(r["fwdbwd_ms"] > 0 and "skipped" not in r for r in records)
