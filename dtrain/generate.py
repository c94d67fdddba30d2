"""Text from a finished run's ``model.safetensors``: samples of a language model, or pronunciations.

    python -m dtrain.generate outputs/shakespeare_char/2026-11-25_12-00-00 --prompt "ROMEO." --tokens 300
    python -m dtrain.generate outputs/cmudict_g2p/2026-11-25_12-00-00 --words dtrain hello

The run directory's latest config rebuilds the model and the training data (for its vocabulary).
The weights (``--weights``, one line on stderr says which): by default the weight average
``model_ema.safetensors`` when the run's latest job kept one (``session.ema_decay``; the G2P recipe
does, and its EMA decodes best), else the final weights ``model.safetensors``; ``--weights last`` or
``--weights ema`` choose. A language model (a model with ``generate``) samples
``--tokens`` characters after ``--prompt``; a model with ``greedy_decode`` over CMUDict's letters
prints each ``--words`` word's phonemes, decoded as the run's test pass decodes (its
``metric.beam_size``) unless ``--beam`` says otherwise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

__all__ = ["load_run", "main"]


#: ``--weights``: the run's own choice (``auto``), its final weights, or its weight EMA
WEIGHTS = ("auto", "last", "ema")
#: the file each choice of weights reads
WEIGHT_FILES = {"last": "model.safetensors", "ema": "model_ema.safetensors"}


def chosen_weights(config, weights: str) -> str:
    """``"last"`` or ``"ema"``: ``auto`` is the EMA when the run's latest job kept one (``session.ema_decay``),
    so an older job's ``model_ema.safetensors`` beside a newer job's weights is never taken."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    if weights != "auto":
        return weights
    return "ema" if (config.get("session") or {}).get("ema_decay") is not None else "last"


def ema_below_horizon(path: Path) -> str | None:
    """Why the weight EMA at ``path`` is too young to use (the reason its run recorded), or ``None``: old enough,
    no such file, or a file from before the reason was recorded."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as weights:
            return (weights.metadata() or {}).get("ema_below_horizon") or None
    except (OSError, SafetensorError):
        return None  # a missing or unreadable file is reported when it is loaded


def load_run(run_dir: str | Path, weights: str = "auto"):
    """``(model, training deserializer, config, which)`` of a finished run, from the config of its latest
    job (a resume's ``config.<n>.yaml``): the model in eval mode with the weights ``weights`` asks for
    (:func:`chosen_weights`; ``which`` says the one loaded, ``"last"`` or ``"ema"``).

    Raises:
        FileNotFoundError / ValueError: no such run, no weights, a config or weights that cannot be read, or
            weights that do not fit the model (one line each, naming the file).
        UserError: the config's model or data cannot be built (one line naming it).
    """
    from dtrain.build import _instantiate as instantiate  # a component's own error as one line naming it
    from dtrain.build import load_run_config
    from dtrain.session.weights import load_weights

    run_dir = Path(run_dir)
    config_path, config = load_run_config(run_dir)
    deserializer = config.source.train.get("deserializer")
    if deserializer is None:
        raise ValueError(f"{config_path}: source.train has no deserializer; expected the config a dtrain run writes")
    which = chosen_weights(config, weights)
    if weights == "auto" and which == "ema":
        young = ema_below_horizon(run_dir / WEIGHT_FILES["ema"])
        if young:  # mostly the weights after the first step: the session did not test it either
            print(f"dtrain.generate: {young}, so the final weights are used (--weights ema for it anyway)",
                  file=sys.stderr)
            which = "last"
    weights_path = run_dir / WEIGHT_FILES[which]
    if not weights_path.is_file():
        what = ("the weight EMA (written when a run with session.ema_decay ends)" if which == "ema"
                else "the trained weights (written when the run ends)")
        raise FileNotFoundError(f"{weights_path} does not exist; expected {what} in a finished run directory")
    model = instantiate(config.model, f"model of {config_path}")
    load_weights(model, weights_path, f"the model of {config_path}")
    data = instantiate(deserializer, f"source.train.deserializer of {config_path}")
    return model.eval(), data, config, which



def _weights_line(run_dir: Path, which: str) -> str:
    """Which weights were loaded, and the other choice where the run has its file (a run without a weight EMA
    is not told to ask for one)."""
    other = "last" if which == "ema" else "ema"
    line = f"weights from {WEIGHT_FILES[which]}"
    return line + (f" (--weights {other} for {WEIGHT_FILES[other]})" if (run_dir / WEIGHT_FILES[other]).is_file() else "")


def _sample_text(model, data, prompt: str, tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    if not hasattr(data, "encode"):
        raise ValueError(f"the run's data ({type(data).__name__}) has no character vocabulary to sample text with")
    start = data.encode(prompt or "\n")[None]
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(start, tokens, temperature=temperature, top_k=top_k, generator=generator)
    return data.decode(out[0].tolist())


def _run_beam_size(config) -> int:
    """The beam the run's decoding metric used (1, greedy, when it has none)."""
    metric = config.get("metric") or {}
    return int(metric.get("beam_size", 1) or 1)


def _pronounce(model, words: list[str], beam_size: int) -> str:
    from dtrain.data.cmudict import GRAPHEMES, PHONEMES, spelling
    from dtrain.data.streams import Sequences

    lines = []
    for word in words:
        spelled = word.lower()
        unknown = sorted(set(spelled) - set(GRAPHEMES))
        if unknown:
            raise ValueError(f"word {word!r} has letters {''.join(unknown)!r} outside CMUDict's {GRAPHEMES!r}")
        ids = torch.tensor([spelling(spelled)])
        source = Sequences(ids, torch.tensor([len(spelled)]))
        output = (model.greedy_decode(source) if beam_size == 1 else model.beam_decode(source, beam_size))[0]
        lines.append(f"{word}\t{' '.join(PHONEMES[i - 3] if 3 <= i < 3 + len(PHONEMES) else '?' for i in output)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.generate", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a finished run's directory (config.yaml and model.safetensors)")
    parser.add_argument("--prompt", default="\n", help="text the sample starts from (language models)")
    parser.add_argument("--tokens", type=int, default=500, help="characters to sample (language models)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest character")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest characters only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=WEIGHTS, default="auto",
                        help="auto (default): the weight EMA when the run kept one, else the final weights; "
                             "last: model.safetensors; ema: model_ema.safetensors")
    parser.add_argument("--ema", dest="weights", action="store_const", const="ema", help="the same as --weights ema")
    parser.add_argument("--words", nargs="+", help="words to pronounce (grapheme-to-phoneme models)")
    parser.add_argument("--beam", type=int, default=None,
                        help="hypotheses of the beam search for --words (1: greedy; default: the run's metric.beam_size)")
    args = parser.parse_args(argv)
    from dtrain.failures import UserError

    try:
        if args.tokens < 1:
            raise ValueError(f"--tokens {args.tokens}: expected a positive number of characters")
        if args.beam is not None and args.beam < 1:
            raise ValueError(f"--beam {args.beam}: expected a positive number of hypotheses (1 decodes greedily)")
        model, data, config, which = load_run(args.run_dir, args.weights)
        print(f"dtrain.generate: {_weights_line(Path(args.run_dir), which)}", file=sys.stderr)
        if args.words:
            if not hasattr(model, "greedy_decode"):
                raise ValueError(f"--words: the run's model {type(model).__name__} does not decode words")
            beam_size = args.beam if args.beam is not None else _run_beam_size(config)
            if beam_size > 1 and not hasattr(model, "beam_decode"):
                raise ValueError(f"--beam {beam_size}: the run's model {type(model).__name__} has no beam search; "
                                 f"--beam 1 decodes greedily")
            print(_pronounce(model, args.words, beam_size))
        else:
            if not hasattr(model, "generate"):
                raise ValueError(f"the run's model {type(model).__name__} does not sample text; --words pronounces "
                                 f"words with a grapheme-to-phoneme model")
            print(_sample_text(model, data, args.prompt, args.tokens, args.temperature, args.top_k, args.seed))
    except (OSError, ValueError, UserError) as error:
        print(f"dtrain.generate: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
