"""imagegen/registry.py: the MMDiT family's record (FLUX.1's: tests/imagegen/test_flux.py), and a family registered
at run time going through `atelier imagegen init --size` and the diffusers loader by its own `_class_name`."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from atelier_studio.flows.cli import main
from atelier_studio.imagegen import flux, qwen_image, registry
from atelier_studio.imagegen.family import Family
from atelier_studio.imagegen.hf import load_pretrained, read_args
from atelier_studio.imagegen.model import FAMILY, SIZES, MMDiT, MMDiTArgs
from atelier_studio.pipeline.errors import ModelLoadError, UsageError


def test_the_mmdit_family_record():
    from diffusers import SD3Transformer2DModel

    assert registry.families() == (FAMILY, flux.FAMILY, qwen_image.FAMILY)
    assert registry.family_of_size("sd3.5-medium") is FAMILY and registry.family_of_size("sd3-medium") is FAMILY
    assert registry.family_of_class_name("SD3Transformer2DModel", "config.json") is FAMILY
    assert FAMILY.diffusers_reference() is SD3Transformer2DModel
    model = MMDiT(SIZES["tiny"])
    assert registry.family_of_args(model.args) is FAMILY
    assert FAMILY.blocks(model) == list(model.transformer_blocks)
    assert FAMILY.train_flops(model, 2, 16, 7) == model.train_flops(2, 16, 7)
    assert FAMILY.args_of_size("tiny", in_channels=3) == dataclasses.replace(SIZES["tiny"], in_channels=3)
    with pytest.raises(UsageError, match=r"unknown imagegen size 'sd4'; known: MMDiT: tiny, demo, sd3-medium"):
        registry.family_of_size("sd4")


# A family of its own: the MMDiT under another diffusers class name (as a fork of SD3's transformer would be).
@dataclasses.dataclass(frozen=True)
class ForkArgs(MMDiTArgs):
    def to_diffusers_config(self) -> dict:
        return {**super().to_diffusers_config(), "_class_name": "ForkTransformer2DModel"}

    @classmethod
    def from_diffusers_config(cls, config: dict, source: str = "config", kernels: str = "auto",
                              attention: str = "auto") -> ForkArgs:
        base = MMDiTArgs.from_diffusers_config({**config, "_class_name": "SD3Transformer2DModel"}, source, kernels,
                                               attention)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


class Fork(MMDiT):
    pass


FORK = Family(
    name="Fork", class_names=("ForkTransformer2DModel",), args_cls=ForkArgs, model_cls=Fork,
    sizes={"fork-tiny": ForkArgs(**{f.name: getattr(SIZES["tiny"], f.name) for f in dataclasses.fields(MMDiTArgs)})},
    tiny_size="fork-tiny", train_flops=Fork.train_flops, blocks=lambda m: list(m.transformer_blocks),
    diffusers_class="diffusers:SD3Transformer2DModel",
)


def test_a_registered_family_goes_through_init_and_the_loader(tmp_path, capsys):
    registry.register(FORK)
    try:
        assert main(["imagegen", "init", "--size", "fork-tiny", "--out", str(tmp_path / "m"),
                     "--dtype", "float32"]) == 0
        assert "random-init Fork fork-tiny" in capsys.readouterr().out
        assert json.loads((tmp_path / "m" / "config.json").read_text())["_class_name"] == "ForkTransformer2DModel"
        model = load_pretrained(tmp_path / "m")
        assert type(model) is Fork and type(read_args(tmp_path / "m")) is ForkArgs
        ref = MMDiT(SIZES["tiny"])
        assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
        with pytest.raises(ValueError, match="cannot register the imagegen family 'Fork'"):
            registry.register(FORK)
    finally:
        registry.unregister(FORK)
    with pytest.raises(ModelLoadError, match=r"config.json: _class_name 'ForkTransformer2DModel' is not a registered "
                                             r"imagegen family \(registered _class_names — "
                                             r"MMDiT: SD3Transformer2DModel; FLUX.1: FluxTransformer2DModel; "
                                             r"Qwen-Image: QwenImageTransformer2DModel\)"):
        load_pretrained(tmp_path / "m")
    assert main(["imagegen", "init", "--size", "fork-tiny", "--out", str(tmp_path / "gone")]) == 2
    assert "unknown imagegen size 'fork-tiny'" in capsys.readouterr().err
    assert torch.equal(model.pos_embed.pos_embed, ref.pos_embed.pos_embed)  # the same sincos grid: one architecture
