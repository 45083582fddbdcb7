# diffusers_vae.py, next to where you run ./train_ae.sh (pip install diffusers)
from diffusers import AutoencoderKL
from torch import nn
from torch.nn import functional as F


class DiffusersVAE(nn.Module):
    """diffusers' AutoencoderKL (the Stable Diffusion VAE architecture), built from a config."""

    def __init__(self, input_shape, latent_channels=4, widths=(32, 64), kl_weight=1e-6):
        super().__init__()  # input_shape: (C, H, W), given by ae
        channels, size, _ = input_shape
        self.kl_weight = kl_weight
        self.vae = AutoencoderKL(
            in_channels=channels,
            out_channels=channels,
            latent_channels=latent_channels,
            down_block_types=("DownEncoderBlock2D",) * len(widths),
            up_block_types=("UpDecoderBlock2D",) * len(widths),
            block_out_channels=tuple(widths),
            layers_per_block=1,
            sample_size=size,
        )

    def encode(self, x):  # what ae-encode writes and the grids decode: the posterior's mean
        return self.vae.encode(x).latent_dist.mode()

    def decode(self, z):  # a DecoderOutput: ae needs the tensor in it
        return self.vae.decode(z).sample

    def loss(self, x):  # L1 on a sampled latent + kl_weight x KL to N(0, 1)
        posterior = self.vae.encode(x).latent_dist
        l1 = F.l1_loss(self.vae.decode(posterior.sample()).sample, x)
        kl = posterior.kl().mean()  # summed over the latent, averaged over the batch
        return l1 + self.kl_weight * kl, {"l1": l1, "kl": kl}
