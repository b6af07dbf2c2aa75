"""The policy-update table of a multi-GPU device run (tools/gpu_policy_update.sh), from its logs.

    python tools/policy_update_table.py LOGS OUT.md

LOGS holds, per run NAME: NAME.jsonl (the training script's --step-log), NAME.log (its output,
where Megatron reports memory) and a line of runs.jsonl (what ran: model, layout, path, the exact
command, and for a baseline the DualKV run it is compared with); steps.tsv (each step's exit status
and seconds) and environment.json (GPUs, commit). Standard library only: it runs on the device and
here on the logs brought back.

Times are medians over the iterations after the first (the first one compiles and warms up).
MFU counts deduplicated FLOPs for every row: a baseline's useful work is its DualKV run's (same
rollouts), so baseline MFU = useful FLOPs of the DualKV step / (baseline step time x peak x GPUs).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                 r"max allocated: ([\d.]+)")
BACKEND = re.compile(r"DualKV attention backend: (\S+) on \S+")
IMPL = re.compile(r"^\s*transformer_impl \.+ (\S+)", re.M)
# training/providers.log_stock_attention; the class name only: another rank's warning can land in
# the same log before this line's newline (seen: "...SdpaDotProductAttention/.../layers.py:1060: ...")
STOCK_CORE = re.compile(r"stock GPTModel core attention: ([A-Za-z_]\w*)")
ERROR = re.compile(r"(Error|error:|Exception|Killed|out of memory)")
# the cause, before the launcher's own errors that follow it (NCCL reports an exhausted GPU as a failed calloc)
CAUSE = re.compile(r"(out of memory|Failed to CUDA calloc|Killed)", re.I)


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def read_jsonl(path: str) -> list[dict]:
    rows = []
    for line in read_text(path).splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def read_steps(logs: str) -> dict[str, dict]:
    steps = {}
    for line in read_text(os.path.join(logs, "steps.tsv")).splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            steps[parts[0]] = {"rc": parts[1], "s": parts[2], "note": parts[3] if len(parts) > 3 else ""}
    return steps


def step_status(steps: dict, logs: str, name: str) -> str:
    s = steps.get(name)
    if s is None:
        return "not run"
    if s["rc"] == "skipped":
        return f"skipped ({s['note']})"
    if s["rc"] != "0":
        lines = read_text(os.path.join(logs, name + ".log")).splitlines()
        errors = [l.strip() for l in lines if CAUSE.search(l)] or \
                 [l.strip() for l in lines if ERROR.search(l) and "Warning" not in l]
        note = f" ({s['note']})" if s["note"] else ""
        return f"FAILED rc={s['rc']} after {s['s']} s{note}" + (f": {errors[-1][:200]}" if errors else "")
    return f"ok, {s['s']} s"


def run_result(logs: str, name: str) -> dict:
    """One run's numbers: medians over iterations 2.. of its step records, peak memory per rank."""
    recs = read_jsonl(os.path.join(logs, name + ".jsonl"))
    log = read_text(os.path.join(logs, name + ".log"))
    peak = {}
    for m in MEM.finditer(log):
        peak[int(m.group(1))] = float(m.group(4)) / 1024  # max allocated so far, GiB; the last report wins
    timed = recs[1:] or recs
    med = (lambda k: statistics.median(r[k] for r in timed)) if timed else (lambda k: None)
    backend = BACKEND.search(log)
    impl = IMPL.search(log)
    stock = STOCK_CORE.search(log)
    return {"recs": recs, "iterations": len(recs), "timed": len(timed), "s": med("seconds"),
            "tok": med("tokens_per_s"), "packed": med("packed_tokens_per_s"), "tflops": med("useful_tflops"),
            "mfu": med("mfu") if timed and timed[0].get("mfu") is not None else None,
            "totals": recs[-1]["totals"] if recs else None, "peak": peak,
            "attention": backend.group(1) if backend else None, "impl": impl.group(1) if impl else None,
            "stock_core": stock.group(1) if stock else None}


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def render(logs: str) -> str:
    env = {}
    try:
        env = json.load(open(os.path.join(logs, "environment.json")))
    except (OSError, ValueError):
        pass
    runs = read_jsonl(os.path.join(logs, "runs.jsonl"))
    steps = read_steps(logs)
    md = ["# Policy update on one node (tools/gpu_policy_update.sh)", ""]
    md += [f"- {k}: {env[k]}" for k in ("gpus", "gpu_count", "torch", "commit", "cuda_lib") if k in env]
    md.append("")
    md += ["Times: median over the iterations after the first; tok/s: replicated-equivalent tokens "
           "(sum of P + R over responses, the same count for every row of a model) per second; MFU: "
           "deduplicated FLOPs of the DualKV step / (step time x peak x GPUs) for every row; executed "
           "TFLOP/s/GPU: the FLOPs the row's own batch asks for (the replicated problem for a baseline); "
           "peak: Megatron's max allocated, per rank that reports it.", ""]
    md += ["| run | model | layout | path | attention | status | iterations (timed) | s/step | tok/s | "
           "packed tok/s | MFU | executed TFLOP/s/GPU | micro-batches/rank | peak GiB | loss per iteration |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    results = {r["name"]: run_result(logs, r["name"]) for r in runs}
    for run in runs:
        res = results[run["name"]]
        mfu = res["mfu"]
        if run.get("baseline_of"):  # the DualKV step's useful FLOPs in this row's time, or nothing
            base = results.get(run["baseline_of"])
            ok = base is not None and base["s"] and res["s"] and base["mfu"] is not None
            mfu = base["mfu"] * base["s"] / res["s"] if ok else None
        attention = res["attention"] or "?"
        if res["stock_core"]:  # the stock model's own line: which core attention it was built with
            attention = {"SdpaDotProductAttention": "torch SDPA (SdpaDotProductAttention)",
                         "DotProductAttention": "Megatron local spec, unfused (DotProductAttention)"
                         }.get(res["stock_core"], res["stock_core"])
        elif "--no-dualkv" in run["command"]:  # logs from before that line existed: the request, not the fact
            attention = ("torch SDPA (requested)" if "--stock-attention sdpa" in run["command"]
                         else f"stock {res['impl'] or '?'} spec (requested)")
        peak = ", ".join(f"r{k}: {v:.1f}" for k, v in sorted(res["peak"].items())) or "-"
        losses = " ".join(f"{x['loss']:.6f}" for x in res["recs"]) or "-"
        mbs = res["totals"]["micro_batches_per_rank"] if res["totals"] else None
        md.append(f"| {run['name']} | {run['model']} | {run['layout']} | {run['path']} | {attention} | "
                  f"{step_status(steps, logs, run['name'])} | {res['iterations']} ({res['timed']}) | "
                  f"{fmt(res['s'], '.2f')} | {fmt(res['tok'], ',.0f')} | {fmt(res['packed'], ',.0f')} | "
                  f"{fmt(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | "
                  f"{fmt(res['tflops'], '.0f')} | {fmt(mbs, 'd')} | {peak} | {losses} |")
    md.append("")
    for run in runs:
        base_of = run.get("baseline_of")
        a, b = results.get(base_of or ""), results[run["name"]]
        if a and a["s"] and b["s"]:
            pairs = list(zip(a["recs"], b["recs"]))
            worst = max((abs(x["loss"] - y["loss"]) for x, y in pairs), default=None)
            md.append(f"- {run['name']} / {base_of}: {b['s'] / a['s']:.2f}x the time per policy update "
                      f"({b['s']:.2f} vs {a['s']:.2f} s/step); loss of iterations 1-{len(pairs)}: max abs "
                      f"difference {fmt(worst, '.2e')}")
    md += ["", "## Commands", ""]
    for run in runs:
        md += [f"{run['name']}:", "", "    " + run["command"], ""]
    md += ["## Steps", "", "| step | status |", "|---|---|"]
    md += [f"| {name} | {step_status(steps, logs, name)} |" for name in steps]
    return "\n".join(md) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: {argv[0]} LOGS OUT.md")
    report = render(argv[1])
    print(report)
    with open(argv[2], "w") as f:
        f.write(report)


if __name__ == "__main__":
    main(sys.argv)
