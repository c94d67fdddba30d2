"""training_session over named streams in one process: which streams feed the model and the loss,
samples counted in the target's steps, evaluation averaged over steps or sequences, and the checks
made before training (missing streams, context length, vocabularies, torch losses with sequences)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import dtrain
from dtrain.data import DataError, DatasetDeserializer, MinibatchSource, Sequences, StreamArrays, StreamInfo
from dtrain.session import SequenceCrossEntropy, SequenceError, StreamBinding, evaluate
from dtrain.comm import LocalCommunicator

from tests.helpers.sequence_data import VOCABULARY, TinyCausalLM, token_sequences


def session(model, source, tmp_path, **options):
    options.setdefault("inputs", ["text[:-1]"])
    options.setdefault("target", "text[1:]")
    momentum = 0.9 if options.pop("optimizer_momentum", False) else 0.0
    lr = options.pop("lr", 0.3)
    return dtrain.training_session(model, options.pop("loss", SequenceCrossEntropy()),
                                   dtrain.LocalLearner(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)),
                                   source,
                                   options.pop("minibatch_size", 40), run_dir=tmp_path, tensorboard=False,
                                   **{"stream": io.StringIO(), **options})


def test_a_language_model_trains_on_token_steps_and_reports_padding(tmp_path):
    output = io.StringIO()
    torch.manual_seed(0)
    source = MinibatchSource(token_sequences(), randomization_seed=1)
    result = session(TinyCausalLM(), source, tmp_path, max_samples=1500, progress_frequency=500, stream=output).train()
    lines = output.getvalue().splitlines()
    assert source.defining_stream == "text[1:]"  # set from the target: samples are the predicted tokens
    assert any("samples are steps of text[1:] (60 sequences" in line for line in lines), lines
    progress = [line for line in lines if line.startswith("samples ")]
    assert len(progress) == 3 and all("padding " in line for line in progress), progress
    losses = [float(line.split("| loss ")[1].split()[0]) for line in progress]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns the counting sequences
    assert 1500 <= result.samples_seen < 1500 + 15


def test_an_explicit_defining_stream_is_kept_and_the_difference_is_said(tmp_path):
    output = io.StringIO()
    source = MinibatchSource(token_sequences(), defining_stream="text")
    session(TinyCausalLM(), source, tmp_path, max_samples=100, stream=output).train()
    assert source.defining_stream == "text"
    assert "the loss averages over text[1:], so with several ranks each is weighted by its steps of text" \
        in output.getvalue()


def test_micro_batches_of_whole_sequences_give_the_one_pass_update(tmp_path):
    models = []
    for micro in (None, 7):
        torch.manual_seed(0)
        model = TinyCausalLM()
        session(model, MinibatchSource(token_sequences(), randomization_seed=3), tmp_path / str(micro),
                max_samples=200, micro_batch_size=micro).train()
        models.append(model)
    difference = max(float((a - b).detach().abs().max()) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert difference <= 1e-5


class EchoModel(torch.nn.Module):
    """Logits that predict each step's own token, except token ``wrong``, predicted as ``wrong + 1``."""

    def __init__(self, wrong: int):
        super().__init__()
        self.wrong = wrong
        self.scale = torch.nn.Parameter(torch.tensor(5.0))

    def forward(self, tokens: Sequences) -> torch.Tensor:
        predicted = torch.where(tokens.data == self.wrong, (tokens.data + 1) % VOCABULARY, tokens.data)
        return self.scale * torch.nn.functional.one_hot(predicted, VOCABULARY).float()


def test_evaluation_averages_the_loss_over_steps_and_a_sequence_metric_over_sequences():
    data = token_sequences(num_sequences=31, seed=4)
    tokens = [t for t in data.read(np.arange(31))["text"].unpadded()]
    model, binding = EchoModel(wrong=5), StreamBinding(["text"], "text")
    source = MinibatchSource(data, randomize=False, max_sweeps=1)
    steps = sum(len(t) for t in tokens)
    wrong_steps = sum(int((t == 5).sum()) for t in tokens)
    wrong_sequences = sum(bool((t == 5).any()) for t in tokens)
    token_result = evaluate(model, source, 23, SequenceCrossEntropy(), dtrain.session.ClassificationError(),
                            LocalCommunicator(), torch.device("cpu"), binding=binding)
    sequence_result = evaluate(model, source, 23, SequenceCrossEntropy(), SequenceError(), LocalCommunicator(),
                               torch.device("cpu"), binding=binding)
    assert token_result.num_samples == steps
    assert token_result.error == pytest.approx(wrong_steps / steps)
    assert sequence_result.error == pytest.approx(wrong_sequences / 31)
    logits = torch.nn.functional.one_hot(torch.tensor(0), VOCABULARY).float() * 5
    right, wrong = float(-torch.log_softmax(logits, 0)[0]), float(-torch.log_softmax(logits, 0)[1])
    assert token_result.loss == pytest.approx((right * (steps - wrong_steps) + wrong * wrong_steps) / steps, rel=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"inputs": ["tokens"]}, r"session.inputs\[0\]='tokens': the training data has no stream 'tokens'; it has 'text'"),
    ({"target": "label"}, "session.target='label': the training data has no stream 'label'; it has 'text'"),
    ({"target": "text.mask"}, "the loss's target is a stream or a step slice of one, not its mask"),
    ({"inputs": {"x": "text[2"}}, "session.inputs.x='text\\[2': expected a stream name"),
    ({"loss": torch.nn.CrossEntropyLoss()}, "loss CrossEntropyLoss: torch's losses take tensors, but the target "
                                            "'text\\[1:\\]' is a sequence stream"),
])
def test_streams_that_do_not_fit_the_data_are_refused_before_training(tmp_path, options, message):
    with pytest.raises(ValueError, match=message) as error:
        session(TinyCausalLM(), MinibatchSource(token_sequences()), tmp_path, max_samples=10, **options)
    assert "\n" not in str(error.value)
    assert not any(tmp_path.iterdir())  # nothing written


def _one_step_sequences(**streams) -> StreamArrays:
    return StreamArrays({"text": [np.array([index % VOCABULARY]) for index in range(12)], **streams},
                        num_classes={"text": VOCABULARY})


@pytest.mark.parametrize("options, message", [
    ({}, r"session.inputs\[0\]='text\[:-1\]': no sequence of the training data has a step in 'text\[:-1\]' \(the "
         r"longest has 1 step of 'text'\), so the model would read no step; expected sequences of at least 2 steps of "
         r"'text'$"),
    ({"inputs": ["text"]}, r"session.target='text\[1:\]': no sequence of the training data has a step in 'text\[1:\]' "
                           r"\(the longest has 1 step of 'text'\), so the loss would have no target; expected sequences "
                           r"of at least 2 steps of 'text'$"),
])
def test_sequences_too_short_for_a_step_slice_are_refused_before_training(tmp_path, options, message):
    with pytest.raises(ValueError, match=message) as error:
        session(TinyCausalLM(), MinibatchSource(_one_step_sequences()), tmp_path, max_samples=10, **options)
    assert "\n" not in str(error.value)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_defining_slice_that_keeps_no_step_is_refused_by_the_source():
    with pytest.raises(DataError, match=r"^defining_stream='text\[1:\]': no sequence of StreamArrays has a step in "
                                        r"'text\[1:\]' .*so there is no sample to count; expected sequences of at "
                                        r"least 2 steps of 'text'$"):
        MinibatchSource(_one_step_sequences(), defining_stream="text[1:]")
    source = MinibatchSource(_one_step_sequences())
    with pytest.raises(DataError, match=r"^session.target='text\[2:-1\]': .*expected sequences of at least 4 steps"):
        source.use_defining_stream("text[2:-1]", "session.target")
    with pytest.raises(DataError, match=r"^session.target='text\[3:2\]': .*expected a slice that keeps some steps$"):
        source.use_defining_stream("text[3:2]", "session.target")
    assert source.defining_stream == "text" and source.samples_per_sweep == 12  # the source reads on as before


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float32, torch.bool])
def test_ids_that_are_not_integers_are_refused_in_one_line_by_every_kind_of_data(dtype):
    """In-memory streams, a deserializer's declared streams and a torch Dataset's samples: one check, one line."""
    name = str(dtype).replace("torch.", "")
    expected = r"values; expected integer class or token ids$"
    with pytest.raises(DataError, match=rf"^stream 'text' has num_classes=13 but holds {name} {expected}"):
        StreamArrays({"text": [torch.arange(3).to(dtype)] * 4}, num_classes={"text": VOCABULARY})

    class DeclaredIds(_Lying):  # a deserializer of the user's that declares ids of another dtype
        streams = {"text": StreamInfo("text", (), dtype, is_sequence=True, num_classes=VOCABULARY)}

    with pytest.raises(DataError, match=rf"^stream 'text' has num_classes=13 but DeclaredIds holds {name} {expected}"):
        MinibatchSource(DeclaredIds())
    with pytest.raises(DataError, match=rf"^stream 'text' has num_classes=13 but TensorDataset\[0\] holds {name} "
                                        rf"{expected}"):
        DatasetDeserializer(torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.arange(4).to(dtype)),
                            names=["features", "text"], num_classes={"text": VOCABULARY})


def test_a_variable_length_stream_left_out_of_sequences_is_told_to_declare_it_before_training(tmp_path):
    class Lines(torch.utils.data.Dataset):  # token lines of different lengths, as a user's Dataset serves them
        def __len__(self):
            return 12

        def __getitem__(self, index):
            return {"text": torch.arange(2 + index % 5) % VOCABULARY}

    data = dtrain.data.DatasetDeserializer(Lines(), num_classes={"text": VOCABULARY})  # sequences=["text"] forgotten
    with pytest.raises(ValueError, match=r"session.inputs\[0\]='text\[:-1\]': 'text' is declared with one value of "
                                         r"shape \[2\] per sample.*declare it a sequence stream \(sequences=\['text'\]"):
        session(TinyCausalLM(), MinibatchSource(data), tmp_path, max_samples=10)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_sequence_longer_than_the_models_context_is_refused(tmp_path):
    long = StreamArrays({"text": [np.arange(5) % VOCABULARY, np.arange(80) % VOCABULARY]},
                        num_classes={"text": VOCABULARY})
    with pytest.raises(ValueError, match=r"sequence 1 of the training data has 79 steps but the model's context_length is 64"):
        session(TinyCausalLM(), MinibatchSource(long), tmp_path, max_samples=10)


class _Lying:
    """Declares a vocabulary of 13 but serves the id 40."""

    streams = {"text": StreamInfo("text", (), torch.int64, is_sequence=True, num_classes=VOCABULARY)}
    num_sequences = 4

    def sequence_lengths(self, name):
        return np.full(4, 3)

    def read(self, indices):
        return {"text": [torch.tensor([1, 40, 2]) for _ in indices]}


def test_a_token_outside_the_vocabulary_is_refused_on_the_first_minibatch(tmp_path):
    model = TinyCausalLM()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DataError, match=r"stream 'text' has the id 40 in the first minibatch, outside its vocabulary "
                                        r"\[0, 13\)"):
        session(model, MinibatchSource(_Lying()), tmp_path, max_samples=10).train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step was taken


class _WideEmbedding(TinyCausalLM):
    """Takes token ids up to 39 but predicts only VOCABULARY classes."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(40, 16)


@pytest.mark.parametrize("model, message", [
    (TinyCausalLM, r"^session.inputs='text\[:-1\]': stream 'text' holds the id 3\d, but the model's token embedding "
                   r"takes 13 ids; expected ids in \[0, 13\)"),
    (_WideEmbedding, r"^session.target='text\[1:\]': stream 'text' holds the id 3\d, but the model has 13 outputs; "
                     r"expected ids in \[0, 13\) \(declare the stream's num_classes"),
])
def test_ids_past_the_models_size_without_num_classes_are_named_as_the_datas_problem(tmp_path, model, message):
    """No num_classes declared: the ids are found where torch's embedding or loss fails on them, at the fifth
    minibatch, and named in one line (not an IndexError); the run directory it created goes again."""
    text = [(start + np.arange(6)) % VOCABULARY for start in range(40)]
    text[30] = np.array([1, 2, 33, 4, 35])  # read with the fifth minibatch of 40 steps, in order
    source = MinibatchSource(StreamArrays({"text": text}), randomize=False)
    run_dir = tmp_path / "run"
    with pytest.raises(DataError, match=message) as error:
        session(model(), source, run_dir, max_samples=200, progress_frequency=40).train()
    assert "\n" not in str(error.value) and not run_dir.exists()


class _Tagger(torch.nn.Module):
    """Per-step logits over VOCABULARY tags for every step of ``words``."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCABULARY, VOCABULARY)

    def forward(self, words: Sequences) -> torch.Tensor:
        return self.embedding(words.data)


def test_a_per_step_target_shorter_than_the_models_output_or_its_input_is_refused(tmp_path):
    """A target that leaves output steps without a target would train on part of the output silently."""
    with pytest.raises(DataError, match=r"^session.target='text\[2:\]': the model outputs \d+ steps per sequence but "
                                        r"the target has at most \d+; expected a target step for every output step"):
        session(TinyCausalLM(), MinibatchSource(token_sequences()), tmp_path / "a", max_samples=100,
                target="text[2:]").train()
    words = [(start + np.arange(6)) % VOCABULARY for start in range(40)]
    tags = [word.copy() for word in words]
    tags[3] = tags[3][:4]  # a tag sequence two steps shorter than its words
    source = MinibatchSource(StreamArrays({"words": words, "tags": tags}), randomize=False, defining_stream="tags")
    with pytest.raises(DataError, match=r"^session.target='tags': sequence 3 of the minibatch has 4 target steps but 6 "
                                        r"steps of the input 'words'; expected a target step for every input step"):
        session(_Tagger(), source, tmp_path / "b", max_samples=100, inputs=["words"], target="tags").train()
    source = MinibatchSource(StreamArrays({"words": words, "tags": [word.copy() for word in words]}), randomize=False)
    session(_Tagger(), source, tmp_path / "c", max_samples=100, inputs=["words"], target="tags").train()  # aligned


def test_a_run_resumed_mid_sweep_from_a_checkpoint_ends_bit_identical(tmp_path):
    """Checkpoints every 300 tokens: the run restored from its second-to-last checkpoint ends with the
    parameters of the uninterrupted run, bit for bit (data position, optimizer and RNG restored)."""
    def run(run_dir, model) -> None:
        source = MinibatchSource(token_sequences(), randomization_seed=6, length_bucketing=4)
        # lr 0.1: with momentum 0.9 the helper's 0.3 diverged (the training loss fell to 1.49, ended at 23.3)
        session(model, source, run_dir, max_samples=1200, optimizer_momentum=True, lr=0.1,
                checkpoint_config=dtrain.CheckpointConfig("ckpt.pt", frequency=300, preserve_all=True)).train()

    torch.manual_seed(0)
    straight = TinyCausalLM()
    run(tmp_path / "a", straight)
    checkpoints = sorted((tmp_path / "a").glob("ckpt-*.pt"), key=lambda path: int(path.stem.split("-")[1]))
    assert len(checkpoints) >= 4
    assert dtrain.load_checkpoint(checkpoints[1])["source"]["position"] % 60 != 0  # mid-sweep (60 sequences a sweep)
    for later in checkpoints[2:]:
        later.unlink()
    torch.manual_seed(123)  # another initial model: everything must come from the checkpoint
    resumed = TinyCausalLM()
    run(tmp_path / "a", resumed)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_resuming_with_samples_counted_differently_is_refused_naming_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    session(TinyCausalLM(), MinibatchSource(token_sequences()), tmp_path, max_samples=200,
            checkpoint_config=dtrain.CheckpointConfig("ckpt.pt")).train()
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    changed = session(TinyCausalLM(), MinibatchSource(token_sequences()), tmp_path, max_samples=400,
                      inputs=["text"], target="text", checkpoint_config=dtrain.CheckpointConfig("ckpt.pt"))
    with pytest.raises(dtrain.CheckpointError, match=r"checkpoint .*ckpt-\d+\.pt does not fit this run's training data: "
                                                     r"checkpoint state counts samples in steps of 'text\[1:\]'"):
        changed.train()
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()} == before


def test_a_finished_run_whose_whole_sequences_overshot_max_samples_runs_again_training_nothing(tmp_path):
    """Whole sequences end the run past max_samples; the same run again restores its end and trains nothing (as
    CNTK does), while a run asked for fewer samples than a checkpoint holds is still refused."""
    def run(max_samples: int):
        torch.manual_seed(0)
        model = TinyCausalLM()
        return model, session(model, MinibatchSource(token_sequences(), randomization_seed=2), tmp_path,
                              max_samples=max_samples, checkpoint_config=dtrain.CheckpointConfig("ckpt.pt"))

    model, first = run(100)
    ended = first.train()
    assert ended.samples_seen > 100  # the last minibatch's whole sequences overshot it
    end = tmp_path / f"ckpt-{ended.samples_seen}.pt"
    assert ended.last_checkpoint == end
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.is_file()}
    again_model, again = run(100)
    result = again.train()
    assert result.restored_from == end and result.samples_seen == ended.samples_seen
    assert result.minibatches == ended.minibatches and result.last_checkpoint == end  # nothing trained
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again_model.parameters()))
    assert {path.name: path.read_bytes() for path in tmp_path.glob("ckpt-*.pt")} == \
        {name: data for name, data in before.items() if name.startswith("ckpt-")}
    # a lower max_samples than the run that wrote the checkpoint: it would report a longer run as this one
    with pytest.raises(dtrain.CheckpointError, match=rf"has trained on {ended.samples_seen} samples, past "
                                                     rf"session.max_samples=99"):
        run(99)[1].train()


def test_a_stream_missing_from_the_test_data_names_that_data(tmp_path):
    test = MinibatchSource(StreamArrays({"words": [np.arange(3) % VOCABULARY]}), randomize=False, max_sweeps=1)
    with pytest.raises(ValueError, match=r"session.inputs\[0\]='text\[:-1\]': the test data has no stream 'text'; "
                                         r"it has 'words'"):
        session(TinyCausalLM(), MinibatchSource(token_sequences()), tmp_path, max_samples=10,
                test_config=dtrain.TestConfig(test))
