"""Serve a target with an exported Eagle3 draft through vLLM's offline ``LLM`` and record, for
each prompt, the greedy output and the draft's proposals of every round.

Runs in the serving venv (vLLM's CPU build pins its own torch), not in ringattn's:

    .venv-serving/bin/python tests/serving/serve_vllm.py plan.json result.json

``plan.json``: ``{"prompts": [[ids...], ...], "max_tokens": N, "runs": [{"name": ...,
"target": DIR, "draft": DIR or null, "as_model": bool}, ...]}``. A run with ``as_model``
loads the draft alone, ``LLM(model=<draft dir>)``: vLLM reads the target from the draft's
``speculators_config.verifier``; without a draft the target runs alone. The runs share one
process (vLLM's import and start-up are most of the time). Prompts are token ids
(``skip_tokenizer_init``: the test targets have no tokenizer).

The proposals are observed, not changed: the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the model runner's ``propose_draft_token_ids`` is
wrapped to keep what it returns. One prompt at a time, so each call's one row is that
prompt's round.

A plan with ``"readme": {"dir": DIR, "target": DIR, "ids": [...]}`` also runs the README's
vLLM block as printed (read from README.md), in ``dir`` (which holds
``OUT/draft-speculators``), with ``TARGET_DIR`` and ``ids`` given; its output's token ids are
the result's ``"readme"``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (readme_blocks.py)
from readme_blocks import readme_block  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

K = 3
"""Speculative tokens per round."""
MARKER = "from vllm import LLM, SamplingParams"
"""The first line of the README's vLLM block (and of no other block)."""


def serve_readme(run: dict) -> list[int]:
    """The README's vLLM block as printed, in ``run["dir"]`` (relative paths such as
    ``OUT/draft-speculators`` are the reader's working directory): the generated ids."""
    names = {"TARGET_DIR": run["target"], "ids": run["ids"]}
    here = os.getcwd()
    os.chdir(run["dir"])
    try:
        exec(compile(readme_block(MARKER), "README.md (vLLM block)", "exec"), names)
    finally:
        os.chdir(here)
    ids = list(names["out"][0].outputs[0].token_ids)
    names["llm"].llm_engine.engine_core.shutdown()
    return ids


def _record_proposals(rounds: list):
    """Wrap the model runner's ``propose_draft_token_ids`` so that each call's proposals
    (one row: one request) are appended to ``rounds``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids

    def propose(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        rows = out.tolist() if hasattr(out, "tolist") else [list(r) for r in out]
        rounds.append([int(t) for t in rows[0]] if rows else [])
        return out

    GPUModelRunner.propose_draft_token_ids = propose


def serve(run: dict, prompts: list, max_tokens: int, rounds: list) -> list[dict]:
    """One run of the plan: each prompt's greedy output and the proposals of its rounds."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
              max_num_seqs=1, seed=0)
    if run.get("as_model"):
        llm = LLM(model=run["draft"], **kw)
    elif run.get("draft"):
        llm = LLM(model=run["target"], speculative_config={
            "model": run["draft"], "method": "eagle3", "num_speculative_tokens": K}, **kw)
    else:
        llm = LLM(model=run["target"], **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    results = []
    for prompt in prompts:
        start = len(rounds)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        results.append({"output": list(out[0].outputs[0].token_ids),
                        "proposals": rounds[start:]})
    llm.llm_engine.engine_core.shutdown()
    del llm
    import gc

    gc.collect()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="the JSON plan (see the module doc)")
    parser.add_argument("out", help="JSON file to write: {run name: [per prompt results]}")
    args = parser.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    rounds: list = []
    _record_proposals(rounds)
    results = {run["name"]: serve(run, plan["prompts"], plan["max_tokens"], rounds)
               for run in plan["runs"]}
    if plan.get("readme"):
        results["readme"] = serve_readme(plan["readme"])
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
