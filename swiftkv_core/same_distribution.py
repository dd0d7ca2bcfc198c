"""Whether two sets of sampled answers come from one output distribution: the check behind every path that claims to
leave sampled outputs unchanged (speculative decoding, dual mode's base mode, prefix caching).

For each prompt and each of the first positions, the tokens sampled there under A and under B form a 2 x k table;
Pearson's chi-square test of homogeneity gives a p-value per table. Tokens too rare for the chi-square approximation
(fewer than MIN_COUNT samples in A and B together) are pooled into one category. Every table is one test of the same
null hypothesis ("A and B sample alike"), so the family is held at `alpha` by Bonferroni: B differs from A when any
table's p-value is below alpha / tables. An answer that ended before a position counts as the category END there.

Marginals at later positions are compared as they are (each conditioned on the answers' own earlier tokens): under
the null hypothesis they are equal, and a wrong sampler shows at the first draft position it touches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

END = "<end>"
MIN_COUNT = 10  # samples of a category in A and B together: expected counts of 5 or more when A and B are equal
POSITIONS = 8


@dataclass(frozen=True)
class Table:
    prompt: int
    position: int
    statistic: float
    dof: int
    p_value: float


@dataclass(frozen=True)
class Comparison:
    alpha: float
    tables: tuple[Table, ...]

    @property
    def threshold(self) -> float:
        return self.alpha / max(1, len(self.tables))

    @property
    def worst(self) -> Table:
        return min(self.tables, key=lambda t: t.p_value)

    @property
    def differ(self) -> bool:
        return self.worst.p_value < self.threshold

    def summary(self) -> str:
        w = self.worst
        verdict = "differ" if self.differ else "indistinguishable"
        return (f"{verdict} at family-wise alpha {self.alpha:g} over {len(self.tables)} tables: smallest p {w.p_value:.3g} "
                f"(prompt {w.prompt}, position {w.position + 1}, chi2 {w.statistic:.1f}, dof {w.dof}) against {self.threshold:.3g}")


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with `dof` degrees of freedom (the regularised upper incomplete gamma)."""
    if dof <= 0:
        return 1.0
    import torch

    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))


def homogeneity(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int = MIN_COUNT) -> tuple[float, int, float]:
    """Chi-square test that samples `a` and `b` come from one categorical distribution -> (statistic, dof, p)."""
    ca, cb = Counter(a), Counter(b)
    kept = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    rest = (sum(ca.values()) - sum(ca[k] for k in kept), sum(cb.values()) - sum(cb[k] for k in kept))
    rows = [(ca[k], cb[k]) for k in kept]
    if sum(rest) >= min_count:
        rows.append(rest)
    elif rows and sum(rest):  # too few to stand alone: into the smallest kept category
        i = min(range(len(rows)), key=lambda j: sum(rows[j]))
        rows[i] = (rows[i][0] + rest[0], rows[i][1] + rest[1])
    na, nb = sum(r[0] for r in rows), sum(r[1] for r in rows)
    if len(rows) < 2 or not na or not nb:
        return 0.0, 0, 1.0
    n = na + nb
    statistic = sum((x - e) ** 2 / e for r in rows for x, e in ((r[0], na * sum(r) / n), (r[1], nb * sum(r) / n)))
    dof = len(rows) - 1
    return statistic, dof, chi_square_sf(statistic, dof)


def at(answer: Sequence[int], position: int) -> Hashable:
    return answer[position] if position < len(answer) else END


def compare(a: Sequence[Sequence[Sequence[int]]], b: Sequence[Sequence[Sequence[int]]], alpha: float,
            positions: int = POSITIONS) -> Comparison:
    """`a[p]`, `b[p]`: the answers (token ids) sampled for prompt p under A and under B."""
    if len(a) != len(b):
        raise ValueError(f"A has answers for {len(a)} prompts, B for {len(b)}")
    tables = []
    for p, (answers_a, answers_b) in enumerate(zip(a, b)):
        for i in range(positions):
            stat, dof, pv = homogeneity([at(x, i) for x in answers_a], [at(x, i) for x in answers_b])
            tables.append(Table(p, i, stat, dof, pv))
    return Comparison(alpha, tuple(tables))
