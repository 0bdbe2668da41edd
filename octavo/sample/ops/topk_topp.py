"""The random path of the sampler: temperature, min-p, top-k, top-p, and the draw itself.

Owns the batched, argmax-invariant filters and the inverse-CDF sampler. Filters take
(num_reqs, vocab) float32 logits and edit them in place: a token a filter drops gets -inf, so the
next softmax gives it probability 0. A row whose parameter holds the neutral value (temperature
1, min_p 0, top_k 0, top_p 1) is left bit-for-bit unchanged whatever the other rows ask, which is
what makes a seeded request's tokens independent of its batch. Must not loop in Python over rows
or the vocabulary (the only per-row loop is over seeded generators), and must not sync with the
device except where a comment says why.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def apply_temperature(logits: Tensor, temperature: Tensor) -> None:
    """Divide each row by its temperature; greedy rows (0.0) are divided by 1.

    A greedy row's random sample is thrown away later, but dividing by 0 would fill it with
    inf/nan first, so it is left as is.
    """
    # (num_reqs, 1)
    divisor = torch.where(temperature == 0.0, 1.0, temperature).unsqueeze(1)
    logits.div_(divisor)


def apply_min_p(logits: Tensor, min_p: Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's top probability.

    p_i < min_p * p_max is the same test as l_i < l_max + log(min_p) (the softmax denominator
    cancels), so this needs one max over the vocabulary instead of a softmax. A row with min_p 0
    gets a threshold of -inf and keeps everything.
    """
    # (num_reqs, 1)
    threshold = logits.amax(dim=1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> None:
    """Keep each row's top_k tokens, then the smallest head of those whose mass reaches top_p.

    top_k 0 (or >= vocab) and top_p 1.0 are off. Tokens tied with the k-th largest logit are all
    kept, so a row may keep more than k tokens when logits tie. top-p is measured on the top-k
    survivors renormalised (vLLM's order), and always keeps the most likely token.

    Why two paths: with top-k alone a partial selection (torch.topk of the largest k asked in the
    batch) finds each row's k-th value and gives exactly the full-sort answer at a fraction of the
    cost. top-p needs each row's cumulative mass in sorted order up to a cut that is only known
    after summing; a partial selection would need to guess how many tokens reach the mass and
    retry (a device sync per try), so any top-p row makes the whole batch take one full sort.
    """
    if top_p is not None:
        _apply_top_k_top_p_sorted(logits, top_k, top_p)
    elif top_k is not None:
        _apply_top_k_partial(logits, top_k)


def _effective_top_k(top_k: Tensor, vocab_size: int) -> Tensor:
    # 0 means off, and k beyond the vocabulary keeps everything: both become vocab_size.
    return torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)


def _apply_top_k_partial(logits: Tensor, top_k: Tensor) -> None:
    vocab_size = logits.shape[1]
    k = _effective_top_k(top_k, vocab_size)
    k_on = k < vocab_size
    # Rows with top-k off ask for 1 so they do not make the selection a full sort.
    k = torch.where(k_on, k, 1)
    # The one host sync on this path: torch.topk takes k as a Python int. It costs one scalar
    # copy, far less than the full sort it avoids.
    max_k = int(k.max())
    # (num_reqs, max_k), largest first
    top_values = logits.topk(max_k, dim=1).values
    # (num_reqs, 1): the k-th largest logit of each row, -inf where top-k is off.
    kth_value = top_values.gather(1, (k - 1).unsqueeze(1))
    kth_value.masked_fill_(~k_on.unsqueeze(1), _NEG_INF)
    logits.masked_fill_(logits < kth_value, _NEG_INF)


def _apply_top_k_top_p_sorted(logits: Tensor, top_k: Tensor | None, top_p: Tensor) -> None:
    vocab_size = logits.shape[1]
    # (num_reqs, vocab) each, largest first. Stable, so tied tokens keep their index order and a
    # top-p cut inside a tie keeps the lowest ids, as argmax would: the result is reproducible.
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True, stable=True)
    if top_k is not None:
        # A row with top-k off compares against its smallest logit, which drops nothing.
        k_index = (_effective_top_k(top_k, vocab_size) - 1).unsqueeze(1)
        kth_value = sorted_logits.gather(1, k_index)
        sorted_logits.masked_fill_(sorted_logits < kth_value, _NEG_INF)
    # (num_reqs, vocab)
    probs = sorted_logits.softmax(dim=1)
    # Mass strictly before each token. A token is kept while that mass is below top_p, so the
    # first token (mass 0, exactly) is always kept and the cut token that reaches top_p is too.
    mass_before = probs.cumsum(dim=1) - probs
    # Rows with top_p 1.0 are excluded explicitly: rounding can push mass_before of the last
    # tokens to 1.0 and would drop them.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits.masked_fill_(drop, _NEG_INF)
    logits.scatter_(1, sorted_idx, sorted_logits)


def random_sample(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """One token per row drawn from `probs` (num_reqs, vocab); returns (num_reqs,) int64.

    Inverse-CDF sampling: one uniform u per row (draw_uniforms), scaled by the row's total
    mass, and the first token whose cumulative probability exceeds it. One random number per
    row instead of one per vocabulary entry: on a CPU, filling (num_reqs, vocab) with
    exponential noise (the exponential race vLLM uses on GPUs) costs several times the rest of
    the sampler, while a cumsum and a binary search are cheap. Like the race it needs no
    host-device sync (unlike torch.multinomial), and the cumsum runs along each row alone.

    Zero-probability tokens are never picked: their cumulative value equals their
    predecessor's, so the first entry above u always has mass. `probs` is not modified.
    """
    # (num_reqs, vocab) running mass; its last column is the row total (1 up to rounding).
    cdf = probs.cumsum(dim=1)
    return invert_cdf(cdf, draw_uniforms(probs.shape[0], generators, probs.device))


def draw_uniforms(
    num_reqs: int, generators: dict[int, torch.Generator], device: torch.device
) -> Tensor:
    """(num_reqs, 1) float32 uniforms in [0, 1): the unseeded rows' in one call, each seeded
    row's one value from its own generator, so a seed gives the same tokens whatever the batch
    size or row position."""
    uniform = torch.empty(num_reqs, 1, device=device, dtype=torch.float32)
    if len(generators) < num_reqs:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    return uniform


def invert_cdf(cdf: Tensor, uniform: Tensor) -> Tensor:
    """(num_reqs, vocab) cumulative mass and (num_reqs, 1) u in [0, 1) -> (num_reqs,) the first
    token whose cumulative mass exceeds u * total."""
    total = cdf[:, -1:]
    # u * total can round up to total; keep the threshold strictly below it so the search
    # always lands on a token with mass.
    threshold = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1)
