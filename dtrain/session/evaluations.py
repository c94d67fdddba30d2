"""The evaluation passes of a training run: cross-validation during training, and at the end the test of the
model (and of its weight EMA), with BatchNorm statistics recomputed first when asked.

A test source that is the cross-validation source (the command line makes them one when ``source.test`` and
``source.cv`` are configured alike) is not read again at the end when the last cross-validation evaluated the
final model on the same samples: that result is the test's. A weight EMA that has taken in fewer optimizer
steps than its horizon is not tested (it is still mostly the weights after the first step)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtrain.session.batchnorm_recompute import recompute_batchnorm_statistics
from dtrain.session.collapse import UNSTABLE_TEST_FRACTION, CollapseWatch
from dtrain.session.configs import CrossValidationConfig, TestConfig
from dtrain.session.evaluate import Evaluation, evaluate
from dtrain.session.measures import Measures
from dtrain.session.metrics import MetricsWriter
from dtrain.session.progress import EvaluationProgress
from dtrain.session.results import TrainingCollapsed, TrainingDiverged

#: what a classifier that never left chance may have met
NEVER_LEARNED_CAUSES = "too few samples, a learning rate too low or too high, or labels unrelated to the inputs"


@dataclass(frozen=True)
class BatchNormStatistics:
    """How the BatchNorm statistics tested and exported are made: ``statistics`` is ``"running"`` (training's) or
    ``"recomputed"`` (measured over ``samples`` global training samples, reduced through ``sync`` when not
    ``None``, under ``precision``)."""

    statistics: str = "running"
    samples: int = 0
    sync: object = None
    precision: str = "32"

    @property
    def recomputed(self) -> bool:
        return self.statistics == "recomputed"


class EvaluationPasses:
    """Cross-validation during training and the test passes at the end, with the end-of-run judgement of the
    training loss; what they warn of is kept in ``warnings`` for the summary.

    Args:
        model, loss, learner, device, binding: what is evaluated, with what, where, and how it takes the streams.
        measures: the metric or the objective's figures, as the reports name them.
        cv_config, test_config: the evaluations configured (``None``: none).
        ema: the weight EMA, tested beside the model (``None``: none).
        collapse: the training loss's watch, which judges the end of the run.
        batchnorm: how the tested statistics are made.
        source, minibatch_size: the training data and its minibatch sizes (read to recompute BatchNorm statistics).
        advice: what to change after a divergence or a collapse.
        start_outputs: the run's first writes, made before the first test record (``TrainingSession._start_outputs``).
    """

    def __init__(self, *, model: torch.nn.Module, loss, measures: Measures, learner, device: torch.device, binding,
                 cv_config: CrossValidationConfig | None, test_config: TestConfig | None, ema,
                 collapse: CollapseWatch, batchnorm: BatchNormStatistics, source, minibatch_size,
                 advice: Callable[[], str], start_outputs: Callable[[MetricsWriter], None]):
        self.model, self.loss, self.measures = model, loss, measures
        self.learner, self.comm, self.device, self.binding = learner, learner.comm, device, binding
        self.cv_config, self.test_config, self.ema = cv_config, test_config, ema
        self.collapse, self.batchnorm = collapse, batchnorm
        self.source, self.minibatch_size = source, minibatch_size
        self.advice, self.start_outputs = advice, start_outputs
        self.cv_index = 0  # the next cross-validation's number (a resumed run: its checkpoint's)
        self.warnings: list[str] = []  # said in the summary, after the test lines they are about
        self._last_cv: tuple[int, Evaluation] | None = None  # samples seen at the last cross-validation, its result

    def cross_validate(self, printer, metrics) -> tuple[Evaluation | None, bool]:
        """One cross-validation of the synchronised model, printed and written to the metrics, then the CNTK
        callback's say; returns its result (``None``: no source) and whether training goes on."""
        config = self.cv_config
        measures = self.measures
        result = None
        if config.minibatch_source is not None:
            self.learner.synchronize()  # evaluate the one model every worker agrees on
            measures.figure_names()  # an objective's figures, known on every rank before their sums are reduced
            result = evaluate(self.model, config.minibatch_source, config.minibatch_size, self.loss, measures.metric,
                              self.comm, self.device, max_samples=config.max_samples, binding=self.binding,
                              progress=EvaluationProgress(printer, f"cross-validation {self.cv_index}",
                                                          config.max_samples), objective=measures.objective,
                              collective=self.learner.collective_forward)
            self._last_cv = (self.learner.samples_seen, result)
            printer.line(f"cross-validation {self.cv_index} at {self.learner.samples_seen} samples: "
                         f"loss {result.loss:.4f} | {measures.format(result.error, result.details)} over "
                         f"{result.num_samples} samples")
            metrics.write("cv", self.learner.samples_seen, loss=result.loss, **measures.entries(result),
                          num_samples=result.num_samples)
        keep_going = True
        if config.callback is not None:
            # CNTK: 0 without a source; an objective's run has no error rate: its callback is given the loss
            answer = config.callback(self.cv_index, (result.error if measures.metric is not None else result.loss)
                                     if result else 0.0,
                                     result.num_samples if result else 0, result.num_minibatches if result else 0)
            keep_going = answer is not False
            if not keep_going:
                printer.line(f"cross-validation callback stopped training at {self.learner.samples_seen} samples")
        self.cv_index += 1
        return result, keep_going

    def test(self, printer, metrics: MetricsWriter, samples_seen: int) -> tuple[Evaluation, Evaluation | None]:
        """The test passes at the end of training: the weight EMA's (when kept) and the model's, each written to
        the metrics; a test pass at chance after the training loss had left chance (fallen, or diverged) raises
        ``TrainingCollapsed``, one that never left it is told as a warning."""
        test_ema = None
        too_few = self.ema.too_few_steps() if self.ema is not None else None
        if too_few is not None:
            printer.line(f"weight EMA not tested: {too_few}; train longer, or lower session.ema_decay")
        elif self.ema is not None:
            self.ema.take_rank0s(self.comm)  # evaluated in shares by every rank: one average
            with self.ema.evaluated(self.model) as averaged:  # a sharded model holds the average's shards meanwhile
                if self.batchnorm.recomputed:  # the average's own statistics, not the live model's
                    self.recompute_batchnorm(printer, samples_seen, averaged, "of the weight EMA ")
                test_ema = self._test_pass(averaged, metrics, "test_ema", samples_seen, printer,
                                           "test of the weight EMA")
        test = self._test_pass(self.model, metrics, "test", samples_seen, printer, "test",
                               reuse=self._final_cross_validation(samples_seen))
        judged_accuracy = test.accuracy if self.measures.metric_name == "error" else None  # else the loss decides
        verdict = self.collapse.judge_evaluation(test.loss, judged_accuracy, self.comm)
        if verdict is not None:
            watch = self.collapse
            measured = (f"test accuracy {100 * test.accuracy:.2f}%" if judged_accuracy is not None else
                        f"test loss {test.loss:.4f} ({self.measures.format(test.error, test.details)})")
            chance = watch.chance()
            record = watch.record(self.comm)
            if verdict == "never_learned":
                self.warnings.append(
                    f"warning: {measured} is {chance}: {watch.how_far_it_fell(record.lowest)}; {NEVER_LEARNED_CAUSES}")
            elif verdict == "only_training":
                self.warnings.append(
                    f"warning: {measured} is near {chance}, although the training loss fell to {record.lowest:.4f} and "
                    f"ends at {record.final:.4f}: the model does not generalise (it overfits the training data, or "
                    f"the test data is unlike it)")
            elif verdict == "unstable":
                metric = (f"accuracy {100 * test.accuracy:.2f}%" if judged_accuracy is not None else
                          self.measures.format(test.error, test.details))
                raise TrainingCollapsed(
                    f"training became unstable: test loss {test.loss:.4f} ({metric}) is as high as chance's for "
                    f"{watch.num_classes} classes ({UNSTABLE_TEST_FRACTION:.0%} of ln {watch.num_classes} = "
                    f"{watch.chance_loss:.4f} or more) "
                    f"after the training loss had fallen to {record.lowest:.4f} and then risen to {record.final:.4f} "
                    f"(running average) by the end; {self.advice()}")
            else:
                how = f"fallen to {record.lowest:.4f}" if verdict == "fallen" else f"diverged to {record.highest:.4f}"
                raise TrainingCollapsed(f"training collapsed: {measured} is {chance} after the training loss "
                                        f"had {how}; {self.advice()}")
        return test, test_ema

    def judge_the_training_loss(self, tested: bool) -> None:
        """At the end of training, before the test pass: raises ``TrainingCollapsed`` when the running training
        loss ends back at chance after it had left it (``CollapseWatch.judge_training``), whatever the progress
        points saw; a classifier's test pass judges it instead when there is one (it measures the final model).
        A training loss at chance that never left it is told as a warning when no test pass will tell it."""
        judged = self.collapse.judge_training(self.comm)
        if judged is None:
            return
        verdict, record = judged
        watch = self.collapse
        if verdict == "not_finite":
            raise TrainingDiverged(f"training diverged: the training loss ends at {record.final} (running average) "
                                   f"at {self.learner.samples_seen} samples; {self.advice()}")
        if verdict == "back_at_start":
            raise TrainingCollapsed(
                f"training collapsed: the training loss ends at {record.final:.4f} (running average), back at "
                f"chance for this loss: where it started ({record.first:.4f}, the first minibatch's), after it had "
                f"fallen to {record.lowest:.4f}; {self.advice()}")
        if tested:
            return
        ends = f"the training loss ends at {record.final:.4f} (running average)"
        if verdict == "never_learned":
            self.warnings.append(f"warning: {ends}, at {watch.chance()}; "
                                      f"{watch.how_far_it_fell(record.lowest, 'it')}; {NEVER_LEARNED_CAUSES}")
            return
        how = f"fallen to {record.lowest:.4f}" if verdict == "fallen" else f"diverged to {record.highest:.4f}"
        raise TrainingCollapsed(f"training collapsed: {ends}, {watch.against_chance(record.final)}, after it had "
                                f"{how}; {self.advice()}")

    def note_a_rise_at_the_end(self) -> None:
        """A warning in the summary when the training loss ended far above its best (a run that became
        unstable without reaching chance or NaN: its model is worse than the one it had)."""
        rise = self.collapse.rise_at_the_end(self.comm)
        if rise is not None:
            final, lowest = rise
            times = f"{final / lowest:.1f} times its lowest" if lowest > 0 else "above its lowest"  # a loss may reach 0
            self.warnings.append(
                f"warning: the training loss ended at {final:.4f} (running average), {times} ({lowest:.4f}): "
                f"training became unstable and the final model is worse than it was; {self.advice()}")

    def _final_cross_validation(self, samples_seen: int) -> Evaluation | None:
        """The last cross-validation's result when it is the test's: the test source is the cross-validation
        source, read to the same ``max_samples``, and that evaluation saw the final model (made at the run's last
        samples, where the ranks held one model, with no BatchNorm statistics recomputed since)."""
        cv, test = self.cv_config, self.test_config
        if cv is None or self._last_cv is None or cv.minibatch_source is not test.minibatch_source \
                or cv.max_samples != test.max_samples or self.batchnorm.recomputed:
            return None
        at, result = self._last_cv
        return result if at == samples_seen else None

    def _test_pass(self, model: torch.nn.Module, metrics: MetricsWriter, kind: str, samples_seen: int, printer,
                   what: str, reuse: Evaluation | None = None) -> Evaluation:
        """One test pass of ``model``, written to the metrics as ``kind`` (``test`` or ``test_ema``): ``reuse``,
        the final cross-validation of the same data, when given, else an evaluation (named ``what`` in its
        progress lines)."""
        config, measures = self.test_config, self.measures
        if reuse is not None:
            printer.line(f"test: the cross-validation data; the cross-validation at {samples_seen} samples evaluated "
                         f"this model on it, so its result is the test's (not evaluated twice)")
            result = reuse
        else:
            measures.figure_names()  # an objective's figures, known on every rank before their sums are reduced
            result = evaluate(model, config.minibatch_source, config.minibatch_size, self.loss, measures.metric,
                              self.comm, self.device, max_samples=config.max_samples, binding=self.binding,
                              progress=EvaluationProgress(printer, what, config.max_samples),
                              objective=measures.objective,
                              collective=self.learner.collective_forward)
        accuracy = {"accuracy": result.accuracy} if measures.metric_name == "error" else {}  # 1 - classification error
        self.start_outputs(metrics)
        metrics.write(kind, samples_seen, loss=result.loss, **measures.entries(result), **accuracy,
                      num_samples=result.num_samples)
        return result

    def recompute_batchnorm(self, printer, samples_seen: int, model: torch.nn.Module | None = None,
                             whose: str = "") -> None:
        """``batchnorm_statistics=recomputed``: exact statistics of the final model (or of ``model``, the
        weight EMA) before the test and the export (after the last checkpoint, which keeps the running
        ones training resumes with)."""
        wanted, objective = self.batchnorm.samples, self.measures.objective
        used = recompute_batchnorm_statistics(
            self.model if model is None else model, self.source, int(self.minibatch_size(samples_seen)), wanted,
            self.batchnorm.sync, self.device, binding=self.binding, precision=self.batchnorm.precision,
            forward=(lambda model, batch: objective(model, batch, training=False))
            if objective is not None else None)  # an objective runs the model itself
        printer.line(f"BatchNorm statistics {whose}recomputed over {used:,} training samples"
                     + (f" (the data ended before {wanted:,})" if used < wanted else ""))
