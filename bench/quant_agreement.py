"""Do quantized models answer like the bf16 model? Greedy answers on a held-out JSONL.

    vlforge demo --out /tmp/demo
    python bench/quant_agreement.py /tmp/demo/sft/checkpoint-2000 /tmp/demo/data/val.jsonl --quant nf4 int8 [fp8]

Prints, per method, the fraction of held-out prompts whose answer is identical to the bf16
model's, and each model's exact-match accuracy. (fp8 needs a GPU with compute capability >= 8.9.)
"""

from __future__ import annotations

import argparse
import json

from vlforge.config import QuantConfig
from vlforge.recipes.infer import evaluate_dataset
from vlforge.infer.model import InferenceModel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--quant", nargs="+", default=["nf4", "int8"])
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    reference = evaluate_dataset(InferenceModel.load(args.model, device=args.device), args.data)
    ref_answers = [a["answer"] for a in reference["answers"]]
    print(json.dumps({"quant": "none (bf16)", "n": reference["n"], "accuracy": reference["accuracy"]}))
    for method in args.quant:
        engine = InferenceModel.load(args.model, quant=QuantConfig.from_flag(method), device=args.device)
        report = evaluate_dataset(engine, args.data)
        same = sum(a["answer"] == r for a, r in zip(report["answers"], ref_answers))
        print(json.dumps({"quant": method, "n": report["n"], "identical_to_bf16": same / report["n"],
                          "accuracy": report["accuracy"], "by_task": report["by_task"],
                          "linears": report["quant"]["linears"], "device": str(engine.device)}))


if __name__ == "__main__":
    main()
