"""Held-out evaluation: the schedule's rule (every N versions or S seconds, within a share of the time) and
the figures of a policy whose answers are known (an engine that answers from a table)."""

from __future__ import annotations

import pytest

from echo_p2p.ml.engine import Engine, Sample, SamplingParams
from echo_p2p.ml.tokenizer import build_char_tokenizer, encode_prompts
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.evaluation import EvalConfig, EvalSchedule, Evaluator, evaluate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_first_evaluation_is_due_at_once_then_every_s_seconds():
    clock = Clock()
    schedule = EvalSchedule(EvalConfig(every_seconds=10.0, max_share=0.5), clock)
    assert schedule.due(0)
    schedule.done(0, seconds=0.1)
    clock.now = 9.9
    assert not schedule.due(5)
    clock.now = 10.0
    assert schedule.due(5) and not schedule.due(0)  # a version already scored is not scored again


def test_every_n_versions_and_the_time_share_bound_the_schedule():
    clock = Clock()
    schedule = EvalSchedule(EvalConfig(every_seconds=None, every_versions=3, max_share=0.05), clock)
    schedule.done(10, seconds=1.0)  # an evaluation of 1 s: the next waits 19 s (1 / (1 + 19) = 5%)
    clock.now = 18.9
    assert not schedule.due(20)
    clock.now = 19.0
    assert not schedule.due(12) and schedule.due(13)


class TableEngine(Engine):
    """Greedy: the right answer for the prompts in ``right``, else "zz"; sampled: ``n`` completions of which
    the first is right for the prompts in ``sampled_right``, the others "a"."""

    def __init__(self, tok, task, right: set[str], sampled_right: set[str]):
        self.tok, self.task, self.right, self.sampled_right = tok, task, right, sampled_right
        self.calls: list[tuple[int, float, int | None]] = []

    def _ids(self, text: str) -> list[int]:
        return encode_prompts(self.tok, [text], use_chat_template=False)[0] + [self.tok.eos_token_id]

    def sample(self, prompt_token_ids, n, params: SamplingParams):
        self.calls.append((n, params.temperature, params.seed))
        out = []
        for ids in prompt_token_ids:
            prompt = self.tok.decode(ids)
            n_, c = int(prompt[0]), prompt[1]
            answer = c * n_
            if params.temperature == 0:
                texts = [answer if prompt in self.right else "zz"]
            else:
                texts = [answer if prompt in self.sampled_right else "a"] + ["a"] * (n - 1)
            out.append([Sample(self._ids(t), [-1.0] * (len(t) + 1), True) for t in texts])
        return out

    def load_weights(self, weights) -> None:  # pragma: no cover - not used
        raise NotImplementedError


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_figures_of_a_known_policy(tok):
    task = build_task("count")  # held out: 1a= 2b= 3c= 4d= 5e= 6a=
    ids = list(task.held_out_ids())
    prompts = encode_prompts(tok, [task.prompt(i) for i in ids], use_chat_template=False)
    engine = TableEngine(tok, task, right={"1a=", "2b=", "3c="}, sampled_right={"1a=", "6a="})
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, seed=3)
    figures = evaluate(engine, tok, task, ids, prompts, sampling, samples=4)
    assert figures["eval_accuracy"] == 0.5  # 3 of 6 greedy answers exact
    assert figures["eval_greedy_reward"] == 0.5  # "zz" scores 0 on the others
    assert figures["eval_pass_at_k"] == round(2 / 6, 4) and figures["eval_k"] == 4
    # sampled rewards: 1a= gets "a" four times (1.0 each); 6a= one exact + three "a" (1/6 each);
    # the four others: "a" scores 0 against b/c/d/e
    expected = (4 * 1.0 + 1.0 + 3 / 6) / 24
    assert figures["eval_reward"] == round(expected, 4)
    assert figures["eval_prompts"] == 6 and figures["eval_seconds"] >= 0
    assert engine.calls == [(1, 0.0, 3), (4, 1.0, 3)]  # greedy once per prompt, then k samples


def test_the_evaluator_scores_held_out_prompts_on_schedule_and_counts_its_time(tok):
    task = build_task("count")
    clock = Clock()
    engine = TableEngine(tok, task, right=set(), sampled_right=set())
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7)
    evaluator = Evaluator(EvalConfig(prompts=4, every_seconds=5.0), task, tok, engine, sampling, False, clock)
    assert [task.prompt(i) for i in evaluator.prompt_ids] == ["1a=", "2b=", "3c=", "4d="]
    first = evaluator.maybe(0)
    assert first["eval_version"] == 0 and first["eval_prompts"] == 4 and evaluator.maybe(3) is None
    clock.now = 5.0
    assert evaluator.maybe(3)["eval_version"] == 3
    assert evaluator.evaluations == 2 and evaluator.last["eval_version"] == 3
    assert engine.calls[1][2] == EvalConfig().seed  # the same seed every time: versions compare
    off = Evaluator(EvalConfig(enabled=False), task, tok, engine, sampling, False, clock)
    assert not off.enabled and off.maybe(0) is None
