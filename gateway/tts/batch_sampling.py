"""Per-row sampling for the batched loop: each row its own settings and its own random stream.

Every row of a batched step samples with its own temperature, top-k, top-p and repetition
penalty (tensors with one entry per row), and draws its randomness from its own
``torch.Generator``. The draws are taken on the host, a fixed number per codec frame (one for the
talker's token and one per code-predictor codebook), and handed to the step as a ``[rows, 16]``
tensor of uniforms; a row's sample is the inverse CDF of its filtered distribution at its
uniform. So a row's random stream is consumed in the same order whatever else shares its step, and
the step itself holds no random state (nothing for a CUDA graph to capture or for co-batched rows
to perturb).

Order of operations, as in Hugging Face's logits processors: suppressed ids -> repetition
penalty (talker only) -> temperature -> top-k -> top-p -> sample. Temperature 0 is greedy
(the arg-max after suppression and penalty).

All functions here are pure tensor code without host synchronisation or data-dependent shapes,
so they run inside a captured CUDA graph; the only shape parameter, ``kcap`` (how many sorted
candidates the top-k keeps), is a Python int chosen by the caller per graph.
"""

from __future__ import annotations

import torch

from gateway.tts.engine import Sampling

#: Draws per codec frame: 15 code-predictor codebooks, then the talker's next token.
DRAWS_PER_FRAME = 16
#: Uniforms drawn from a row's generator at a time (a fixed block: the consumption order of a
#: row's stream never depends on anything but the row).
_DRAW_BLOCK = 8 * DRAWS_PER_FRAME


DEFAULT_SAMPLING = Sampling()


def kcap_for(top_ks: list[int], vocab: int) -> int:
    """Sorted candidates a step keeps for rows with these ``top_k`` values.

    Rounded up to a few sizes (64, 256, the vocabulary) so that CUDA graphs are captured for a
    handful of shapes, not one per distinct setting. Keeping more candidates than a row's
    ``top_k`` does not change its sample (the extra ones are masked to zero probability).
    """
    need = max((vocab if k <= 0 or k >= vocab else k) for k in top_ks) if top_ks else 1
    for size in (64, 256):
        if need <= size < vocab:
            return size
    return vocab


class RowDraws:
    """One row's random stream: uniforms in [0, 1) from its own seeded ``torch.Generator``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(seed)
        self._block = torch.empty(_DRAW_BLOCK, dtype=torch.float32)
        self._used = _DRAW_BLOCK

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` uniforms (a view; copy it before the next call)."""
        if self._used + n > _DRAW_BLOCK:
            self._block.uniform_(0.0, 1.0, generator=self._gen)
            self._used = 0
        out = self._block[self._used : self._used + n]
        self._used += n
        return out


class BatchDraws:
    """Every row's random stream in one host buffer, taken for all stepping rows at once.

    Slot ``s`` draws from its own seeded ``torch.Generator`` a block of uniforms at a time, by
    the same rule as :class:`RowDraws` (a block is refilled when the next take does not fit in
    what is left), so a row's stream is consumed in the same order whatever shares its steps.
    :meth:`take_rows` gathers every row's next ``n`` uniforms with one indexed read; only the
    rows whose block ran out (one step in eight) touch their generator.
    """

    def __init__(self, slots: int) -> None:
        self._blocks = torch.zeros(slots, _DRAW_BLOCK, dtype=torch.float32)
        self._used = [_DRAW_BLOCK] * slots
        self._gens: list[torch.Generator | None] = [None] * slots

    def start(self, slot: int, seed: int) -> None:
        """Slot ``slot`` begins the stream of ``seed``."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        self._gens[slot] = gen
        self._used[slot] = _DRAW_BLOCK

    def _ensure(self, slot: int, n: int) -> int:
        used = self._used[slot]
        if used + n > _DRAW_BLOCK:
            self._blocks[slot].uniform_(0.0, 1.0, generator=self._gens[slot])
            used = 0
        self._used[slot] = used + n
        return used

    def take(self, slot: int, n: int) -> torch.Tensor:
        """The slot's next ``n`` uniforms (a copy)."""
        start = self._ensure(slot, n)
        return self._blocks[slot, start : start + n].clone()

    def take_rows(self, slots: list[int], n: int) -> torch.Tensor:
        """``[len(slots), n]``: each slot's next ``n`` uniforms."""
        starts = torch.tensor([self._ensure(slot, n) for slot in slots])
        offsets = starts[:, None] + torch.arange(n)[None, :]
        return self._blocks[torch.tensor(slots)[:, None], offsets]


def sample_rows(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    kcap: int,
) -> torch.Tensor:
    """One token per row from ``logits [n, V]`` (already suppressed / penalised).

    ``uniforms [n]`` are the rows' draws; ``temperature``/``top_k``/``top_p`` are ``[n]``
    tensors. Rows with temperature 0 take the arg-max. ``kcap`` >= every row's effective top-k
    (see :func:`kcap_for`).
    """
    logits = logits.float()
    values, indices = torch.topk(logits, kcap, dim=-1)  # sorted, largest first
    rank = torch.arange(kcap, device=logits.device)
    k_eff = torch.where(top_k > 0, top_k, kcap).clamp(max=kcap)
    keep = rank[None, :] < k_eff[:, None]
    greedy = temperature <= 0
    scaled = values / torch.where(greedy, 1.0, temperature)[:, None]
    scaled = torch.where(keep, scaled, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the token that crosses the
    # threshold stays, and so does the first one).
    before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where(before < top_p[:, None], probs, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    pick = (cdf <= target).sum(dim=-1).clamp(max=kcap - 1)
    pick = torch.where(greedy, 0, pick)
    return indices.gather(1, pick[:, None]).squeeze(1)


def penalise_repeats(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Hugging Face's repetition penalty per row: ids in the row's history ``seen [n, V]``
    have positive logits divided by, negative ones multiplied by, the row's ``penalty [n]``."""
    p = penalty[:, None].to(logits.dtype)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)
