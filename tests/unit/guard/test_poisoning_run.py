"""An editor that arrives on a run is banned within 5 training steps of its first edited group (issue 32's
goal), through the trainer's own parts in the trainer's order (``benchmarks/poisoning.py``: the ingest's
``IngestValidator`` and ``no_signal`` rule, the ``Learner`` with the sample check, the ``SenderGuard``) on
the tiny model, and no honest sampler is struck.

The editor turns each right answer into answer + marker + EOS and reports the edited tokens' true
log-probs: every value true, so only the sample check can see it, here on a policy that answers right at
times: its groups repeat one improbable completion (the duplicate test) and its marker lies in the tail
(the tail test). An editor present from a run's first step is banned later (steps 32-46 in the benchmark):
its early groups hold few right answers to repeat. What the edits would teach without the check, and with
it, at equal updates over 150 steps and two seeds, is the benchmark's (docs/security.md, "What a selective
truth-teller teaches"): too slow for the suite.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "poisoning.py"


def test_an_editor_arriving_on_a_run_is_banned_within_5_steps_of_its_first_edit_and_no_honest_one_is_struck(
    tmp_path, monkeypatch
):
    spec = importlib.util.spec_from_file_location("poisoning_benchmark", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchmark)  # its dataclasses look their module up
    spec.loader.exec_module(benchmark)
    out = tmp_path / "poisoning.json"
    args = ["--arms", "edit", "--fractions", "0.5", "--checks", "on", "--seeds", "2", "--steps", "47"]
    assert benchmark.main([*args, "--attack-from", "40", "--eval-samples", "8", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["results"]
    # it edited from its first step (a policy that answers right at times: repeated edits at once)
    assert run["first_feature_step"] == 40 and run["first_repeat_step"] is not None, run
    assert run["ban_steps"] and run["ban_steps"][0] - run["first_feature_step"] <= 5, run
    assert run["counts"]["attacker_refused_banned"] > 0, run["counts"]  # its later groups: refused unread
    assert run["honest_struck"] == {} and run["honest_banned"] == 0, run
