"""Autoencoders that turn images into the latents the MMDiT is trained on, and back.

Shape legend: B batch, H/W image height/width in pixels, p pixel-codec patch, f downsample factor,
C latent channels, h = H/f, w = W/f.

Both codecs share one interface: `encode(images [B,3,H,W] in [-1,1]) -> latents [B,C,h,w]`,
`decode(latents) -> images`, and the attributes `downsample_factor`, `latent_channels`,
`scaling_factor`, `shift_factor`. Latents handed to the model are always normalised:

    z_model = (z_raw - shift_factor) * scaling_factor          raw = z_model / scaling_factor + shift_factor

- `PixelCodec`: no weights. Space-to-depth (`pixel_unshuffle`) by `patch` p, so C = 3p², f = p. It
  gives the tiny CPU demo real pictures without a VAE. Constants: shift 0 and scale 2. Images in
  [-1, 1] have a per-channel std of about 0.45 (ImageNet's 0.226 in [0, 1], doubled), so ×2 brings
  the latents to roughly unit variance; a power of two with zero shift makes decode(encode(x)) == x
  bit-exact in fp32.
- `SD3VAE`: diffusers `AutoencoderKL` from a local directory; scaling and shift come from its config
  (SD3: scaling_factor 1.5305, shift_factor 0.0609). Encoding takes
  the mode of the latent distribution by default, a sample with `sample=True`.
- `QwenImageVAE` (what `SD3VAE.from_dir` gives for a vae/ of class `AutoencoderKLQwenImage`): Qwen-Image's video
  VAE on one frame, normalised per channel as QwenImagePipeline does, z_model = (z_raw - latents_mean) /
  latents_std: its shift_factor and scaling_factor are the lists latents_mean and 1 / latents_std.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from atelier_studio.data.textfile import read_json
from atelier_studio.pipeline.errors import ModelLoadError, one_line
from atelier_studio.pipeline.hf_files import check_weights_dir


def _check_images(images: torch.Tensor, factor: int, who: str) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{who}.encode expects images [B, 3, H, W], got shape {tuple(images.shape)}")
    if images.shape[2] % factor or images.shape[3] % factor:
        raise ValueError(f"{who}.encode: H and W must be multiples of {factor}, got shape {tuple(images.shape)}")


def _check_latents(latents: torch.Tensor, channels: int, who: str) -> None:
    if latents.ndim != 4 or latents.shape[1] != channels:
        raise ValueError(f"{who}.decode expects latents [B, {channels}, h, w], got shape {tuple(latents.shape)}")


class PixelCodec(nn.Module):
    """Weightless space-to-depth codec: [B,3,H,W] <-> [B,3p²,H/p,W/p], scaled by 2 (see module docstring)."""

    scaling_factor: float = 2.0
    shift_factor: float = 0.0

    def __init__(self, patch: int = 2):
        super().__init__()
        if patch < 1:
            raise ValueError(f"PixelCodec patch must be >= 1, got {patch}")
        self.patch = patch
        self.downsample_factor = patch
        self.latent_channels = 3 * patch * patch

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        _check_images(images, self.patch, "PixelCodec")
        z = F.pixel_unshuffle(images, self.patch)  # [B,3,H,W] -> [B,3p²,H/p,W/p]
        return (z - self.shift_factor) * self.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        _check_latents(latents, self.latent_channels, "PixelCodec")
        z = latents / self.scaling_factor + self.shift_factor
        return F.pixel_shuffle(z, self.patch)  # [B,3p²,h,w] -> [B,3,hp,wp]


def space_to_depth_ref(images: torch.Tensor, patch: int) -> torch.Tensor:
    """Plain reshape reference for PixelCodec's layout: channel c*p*p + i*p + j holds pixel (i, j) of each cell."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch)  # [B,3,h,p,w,p]
    x = x.permute(0, 1, 3, 5, 2, 4)  # [B,3,p,p,h,w]
    return x.reshape(b, c * patch * patch, h // patch, w // patch)  # [B,3p²,h,w]


def find_vae_dir(path: str | Path) -> Path:
    """`path` itself or `path/vae` holding a diffusers AutoencoderKL config.json; clear error otherwise."""
    path = Path(path)
    for candidate in (path, path / "vae"):
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"no AutoencoderKL found at {path}: expected {path / 'config.json'} or {path / 'vae' / 'config.json'} "
        f"(a diffusers VAE directory or a pipeline directory with a vae/ subfolder)"
    )


class SD3VAE(nn.Module):
    """Frozen diffusers AutoencoderKL with SD3's latent normalisation (see module docstring)."""

    def __init__(self, vae: nn.Module, sample: bool = False):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        self.sample = sample
        cfg = vae.config
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(cfg.shift_factor) if getattr(cfg, "shift_factor", None) is not None else 0.0
        self.latent_channels = int(cfg.latent_channels)
        self.downsample_factor = 2 ** (len(cfg.block_out_channels) - 1)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32, sample: bool = False) -> "SD3VAE":
        """The VAE of a diffusers VAE directory (or a pipeline's vae/): an SD3VAE, or for an AutoencoderKLQwenImage a
        QwenImageVAE."""
        import diffusers  # heavy import, only when a VAE is really used

        vae_dir = find_vae_dir(path)
        check_weights_dir(vae_dir, "vae")  # weights there, headers whole: named here, not a diffusers OSError
        config = read_json(vae_dir / "config.json", ModelLoadError)
        name = config.get("_class_name", "AutoencoderKL") if isinstance(config, dict) else None
        codec = {"AutoencoderKL": SD3VAE, "AutoencoderKLQwenImage": QwenImageVAE}.get(name)
        if codec is None:
            raise ModelLoadError(f"{vae_dir / 'config.json'}: _class_name {name!r} is not a VAE Atelier reads "
                                 f"(AutoencoderKL, AutoencoderKLQwenImage)")
        try:
            vae = getattr(diffusers, name).from_pretrained(vae_dir, dtype=dtype, local_files_only=True,
                                                           use_safetensors=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"vae {vae_dir}: cannot load it ({type(e).__name__}: {one_line(str(e))})") from e
        return codec(vae, sample=sample)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """images [B,3,H,W] in [-1,1] -> (z - shift) * scale, z the mode (or a sample) of q(z|x): [B,C,h,w]."""
        _check_images(images, self.downsample_factor, "SD3VAE")
        dist = self.vae.encode(images.to(self.vae.dtype)).latent_dist
        z = dist.sample(generator) if self.sample else dist.mode()
        return (z - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B,C,h,w] -> images [B,3,hf,wf] (roughly in [-1,1]; not clamped)."""
        _check_latents(latents, self.latent_channels, "SD3VAE")
        z = latents.to(self.vae.dtype) / self.scaling_factor + self.shift_factor
        return self.vae.decode(z).sample


class QwenImageVAE(SD3VAE):
    """Frozen diffusers AutoencoderKLQwenImage (a causal video VAE) on single frames, with QwenImagePipeline's
    per-channel latent normalisation (see module docstring)."""

    def __init__(self, vae: nn.Module, sample: bool = False):
        nn.Module.__init__(self)
        self.vae = vae.eval().requires_grad_(False)
        self.sample = sample
        cfg = vae.config
        self.latent_channels = int(cfg.z_dim)
        self.downsample_factor = 2 ** len(cfg.temperal_downsample)  # QwenImagePipeline's vae_scale_factor
        self.shift_factor = [float(m) for m in cfg.latents_mean]  # lists: written to cache.json as they are
        self.scaling_factor = [1.0 / float(s) for s in cfg.latents_std]
        self.register_buffer("mean", torch.tensor(cfg.latents_mean).view(1, -1, 1, 1), persistent=False)
        # 1 / std as QwenImagePipeline computes it: it decodes z / (1 / std) + mean (and diffusers' Qwen-Image
        # training script encodes (z - mean) * (1 / std)), so the same roundings
        self.register_buffer("inv_std", 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1), persistent=False)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """images [B,3,H,W] in [-1,1] -> (z - mean) * (1 / std), z the mode (or a sample) of q(z|x) of one frame:
        [B,C,h,w]."""
        _check_images(images, self.downsample_factor, "QwenImageVAE")
        dist = self.vae.encode(images.to(self.vae.dtype)[:, :, None]).latent_dist  # [B, 3, 1, H, W] in
        z = (dist.sample(generator) if self.sample else dist.mode())[:, :, 0]  # [B, C, h, w]
        return (z - self.mean.to(z)) * self.inv_std.to(z)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B,C,h,w] -> images [B,3,hf,wf] (roughly in [-1,1])."""
        _check_latents(latents, self.latent_channels, "QwenImageVAE")
        z = latents.to(self.vae.dtype) / self.inv_std.to(self.vae.dtype) + self.mean.to(self.vae.dtype)
        return self.vae.decode(z[:, :, None]).sample[:, :, 0]


def resolve_autoencoder_spec(spec: str, model_path: str = "") -> str:
    """`autoencoder.spec` with "model" replaced by `model_path` (a pipeline directory: its vae/ is used)."""
    if spec != "model":
        return spec
    if not model_path:
        from atelier_studio.pipeline.config import ConfigError

        raise ConfigError("autoencoder.spec = 'model' needs model.path: a pipeline directory with a vae/ folder")
    return str(model_path)


def load_autoencoder(spec: str, dtype: torch.dtype = torch.float32) -> PixelCodec | SD3VAE:
    """"pixel" (patch 2) or "pixel:<patch>" -> PixelCodec; anything else is a local VAE directory -> SD3VAE
    (resolve "model" with `resolve_autoencoder_spec` first)."""
    if spec == "pixel" or spec.startswith("pixel:"):
        patch = spec.partition(":")[2] or "2"
        if not patch.isdigit():
            raise ValueError(f"autoencoder spec {spec!r}: expected 'pixel' or 'pixel:<patch int>'")
        return PixelCodec(int(patch))
    return SD3VAE.from_dir(spec, dtype=dtype)
