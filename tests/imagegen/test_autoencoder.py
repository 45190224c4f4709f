"""imagegen/autoencoder.py: PixelCodec exactness, SD3VAE parity with diffusers AutoencoderKL."""

import pytest
import torch
from diffusers import AutoencoderKL

from atelier_studio.imagegen.autoencoder import SD3VAE, PixelCodec, load_autoencoder, space_to_depth_ref


@pytest.mark.parametrize("patch", [1, 2, 4])
def test_pixel_codec_round_trip_is_exact(patch):
    g = torch.Generator().manual_seed(patch)
    images = torch.rand(2, 3, 8 * patch, 12 * patch, generator=g) * 2 - 1
    codec = PixelCodec(patch)
    z = codec.encode(images)
    assert z.shape == (2, 3 * patch * patch, 8, 12)
    assert (codec.latent_channels, codec.downsample_factor) == (3 * patch * patch, patch)
    # exact by construction: a permutation, then a shift of 0 and a scale of 2, which fp32 does without rounding
    torch.testing.assert_close(z, (space_to_depth_ref(images, patch) - codec.shift_factor) * codec.scaling_factor,
                               rtol=0, atol=0)
    assert torch.equal(codec.decode(z), images)


def test_pixel_codec_scale_gives_about_unit_variance():
    # image-like statistics: [0,1] pixels with std ~0.226 (ImageNet), mapped to [-1,1]
    g = torch.Generator().manual_seed(0)
    images = (torch.randn(4, 3, 32, 32, generator=g) * 0.226 + 0.45).clamp(0, 1) * 2 - 1
    std = PixelCodec(2).encode(images).std().item()
    assert 0.7 < std < 1.1


def test_pixel_codec_errors_name_shapes():
    with pytest.raises(ValueError, match=r"multiples of 4, got shape \(1, 3, 10, 12\)"):
        PixelCodec(4).encode(torch.rand(1, 3, 10, 12))
    with pytest.raises(ValueError, match=r"latents \[B, 12, h, w\], got shape \(1, 16, 4, 4\)"):
        PixelCodec(2).decode(torch.rand(1, 16, 4, 4))


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=16, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    root = tmp_path_factory.mktemp("sd3") / "pipeline"
    vae.save_pretrained(root / "vae")
    return root


def test_sd3_vae_matches_diffusers(vae_dir):
    wrapper = load_autoencoder(str(vae_dir))  # the pipeline dir: vae/ is found
    ref = AutoencoderKL.from_pretrained(vae_dir / "vae").eval()
    assert isinstance(wrapper, SD3VAE)
    assert (wrapper.scaling_factor, wrapper.shift_factor) == (1.5305, 0.0609)
    assert (wrapper.latent_channels, wrapper.downsample_factor) == (16, 2)
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 16, 12, generator=g) * 2 - 1
    with torch.no_grad():  # exact: the wrapper runs diffusers' own modules on the same inputs, then the same ops
        expected = (ref.encode(images).latent_dist.mode() - 0.0609) * 1.5305
        z = wrapper.encode(images)
        torch.testing.assert_close(z, expected, rtol=0, atol=0)
        latents = torch.randn(2, 16, 8, 6, generator=g)
        torch.testing.assert_close(wrapper.decode(latents), ref.decode(latents / 1.5305 + 0.0609).sample,
                                   rtol=0, atol=0)
    sampler = SD3VAE.from_dir(vae_dir / "vae", sample=True)
    with torch.no_grad():
        dist = ref.encode(images).latent_dist
        want = (dist.sample(torch.Generator().manual_seed(7)) - 0.0609) * 1.5305
        got = sampler.encode(images, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, z)
    assert not any(p.requires_grad for p in wrapper.parameters())


def test_load_autoencoder_specs_and_errors(tmp_path):
    assert load_autoencoder("pixel").patch == 2 and load_autoencoder("pixel:4").patch == 4
    with pytest.raises(ValueError, match="pixel:<patch int>"):
        load_autoencoder("pixel:x")
    with pytest.raises(FileNotFoundError, match=r"no AutoencoderKL found at .*nowhere.*config\.json"):
        load_autoencoder(str(tmp_path / "nowhere"))
