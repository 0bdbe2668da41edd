"""The random path of the sampler: temperature, min-p, top-k, top-p, and the draw itself.

Owns the batched, argmax-invariant filters and the exponential-race sampler. Filters take
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

    The exponential race: with E_i ~ Exp(1) independent, E_i / p_i ~ Exp(p_i), and the smallest
    of independent exponentials is i with probability p_i / sum(p). So argmax(p / E) is a sample
    of p. Unlike torch.multinomial, which synchronises the host with the device on CUDA and takes
    one generator per call, this needs no sync and suits per-row generators: the noise is drawn
    first, in one call for the unseeded rows and one per seeded row with that row's generator,
    and the rest is batched.

    Seeded rows draw exactly `vocab` values from their own generator each step, regardless of
    batch size or row position, so a seed gives the same tokens in any batch. `probs` is
    overwritten.
    """
    # (num_reqs, vocab). exponential_ never returns 0 (documented), so no 0/0 below.
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=1)
