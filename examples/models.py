"""Example models with seeded weights, built in code (no downloads)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus the identity, then relu."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + x)


class TinyResNet(nn.Module):
    """A small ResNet-style CNN for 3x32x32 images."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width)
        self.down = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.layer2 = BasicBlock(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.down(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class MLP(nn.Module):
    """Four Linear layers with ReLU."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class EncoderLayer(nn.Module):
    """Pre-norm self-attention and feed-forward block with explicit q/k/v projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, 4 * dim)
        self.ff2 = nn.Linear(4 * dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        return x.view(batch, tokens, self.heads, dim // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self._split(self.query(h)), self._split(self.key(h)), self._split(self.value(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask_bias
        context = torch.matmul(scores.softmax(-1), v).transpose(1, 2).flatten(2)
        x = x + self.out(context)
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class TinyEncoder(nn.Module):
    """A two-layer transformer encoder classifier called with input_ids= and attention_mask=."""

    def __init__(self, vocab: int = 1000, dim: int = 64, heads: int = 4, layers: int = 2, classes: int = 4,
                 max_tokens: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_tokens, dim)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.position(positions)
        mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -1e4
        for layer in self.layers:
            x = layer(x, mask_bias)
        return self.classifier(self.norm(x)[:, 0])


def fragile_mlp() -> MLP:
    """An MLP with four hidden units 60x louder than the rest (and the next layer scaled back): float-equivalent,
    but per-tensor int8 activations lose the quiet units, so its output SQNR fails."""
    model = seeded(MLP)
    with torch.no_grad():
        model.layers[2].weight[:4] *= 60.0
        model.layers[4].weight[:, :4] /= 60.0
    return model.eval()


def wide_rows() -> MLP:
    """An MLP whose second layer's weight rows span two orders of magnitude: one per-tensor scale rounds the quiet
    rows coarsely, which per-channel weights fix."""
    model = seeded(MLP)
    with torch.no_grad():
        weight = model.layers[2].weight
        weight *= torch.logspace(-2, 0, weight.shape[0]).unsqueeze(1)
    return model.eval()


def seeded(factory, seed: int = 0):
    """Build a model with a fixed seed, in eval mode."""
    torch.manual_seed(seed)
    return factory().eval()


def settle_batchnorm(model: nn.Module, batches, steps: int = 4) -> nn.Module:
    """Give BatchNorm layers realistic running statistics from a few batches, then return to eval."""
    model.train()
    with torch.no_grad():
        for batch in list(batches)[:steps]:
            model(batch)
    return model.eval()


class WordTokenizer:
    """A whitespace tokenizer over a vocabulary file, standing in for a Hugging Face tokenizer."""

    def __init__(self, vocabulary_path: str) -> None:
        with open(vocabulary_path, encoding="utf-8") as stream:
            words = stream.read().split()
        self.ids = {word: index + 2 for index, word in enumerate(words)}  # 0: padding, 1: unknown

    def __call__(self, sentences: list[str], length: int) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask for `sentences`, padded or cut to `length` tokens."""
        ids = torch.zeros(len(sentences), length, dtype=torch.long)
        mask = torch.zeros(len(sentences), length, dtype=torch.long)
        for row, sentence in enumerate(sentences):
            tokens = [self.ids.get(word, 1) for word in sentence.lower().split()][:length]
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, :len(tokens)] = 1
        return {"input_ids": ids, "attention_mask": mask}


VOCABULARY = ("the a model layer weight scale zero point int8 float error channel batch token input output "
              "quantized observer range outlier signal noise ratio gate regression baseline check").split()


def sentences(count: int, seed: int) -> list[str]:
    """`count` seeded sentences of 6 to 20 vocabulary words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 21, (count,), generator=g).tolist()
    return [" ".join(VOCABULARY[i] for i in torch.randint(0, len(VOCABULARY), (n,), generator=g).tolist())
            for n in lengths]
