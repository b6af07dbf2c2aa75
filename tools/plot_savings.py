"""Tokens and attention FLOPs DualKV saves per layer, as a function of (N, P, R).

    python tools/plot_savings.py                    # writes docs/savings.png
    python tools/plot_savings.py --markdown         # also prints the tables of docs/SAVINGS.md

All counts come from megatron_dualkv.flops (one group: a prompt of P tokens, N responses of R
tokens). The whole-layer column uses the Qwen3-30B-A3B layer shape (DESIGN.md) to weigh the
per-token matrix work against attention.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dualkv.flops import FWD_BWD_FACTOR, attention_flops, savings  # noqa: E402

NS = (8, 16, 32, 64)
PS = (512, 2048, 8192, 32768, 65536)
RS = (256, 1024, 4096)

# Qwen3-30B-A3B, per layer: hidden 2048, 32 query / 4 KV heads of 128, 128 experts top-8 with
# moe_ffn_hidden_size 768 (SwiGLU: 3 matrices), router 2048 x 128.
QWEN3_30B_A3B = dict(hidden=2048, q_heads=32, kv_heads=4, head_dim=128, topk=8, ffn=768, experts=128)


def qwen3_moe_linear_params_per_token(s: dict = QWEN3_30B_A3B) -> int:
    """Weights a token multiplies in one layer (QKV, output projection, router, top-k experts)."""
    h, d = s["hidden"], s["head_dim"]
    qkv = h * (s["q_heads"] + 2 * s["kv_heads"]) * d
    out = s["q_heads"] * d * h
    experts = s["topk"] * 3 * h * s["ffn"]
    router = h * s["experts"]
    return qkv + out + experts + router


def layer_flops(tokens: int, pairs: int, s: dict = QWEN3_30B_A3B) -> float:
    """Forward+backward FLOPs of one layer: matmuls 2*params per token (x3 for fwd+bwd) plus
    attention (x3.5); norms, RoPE, softmax and MoE dispatch are ignored (a few percent)."""
    linear = 2.0 * qwen3_moe_linear_params_per_token(s) * tokens * 3.0
    attn = attention_flops(pairs, s["q_heads"], s["head_dim"], backward=True)
    return linear + attn


def row(n: int, p: int, r: int) -> dict:
    s = savings(n, p, r)
    s["layer_flop_reduction"] = (layer_flops(s["tokens_replicated"], s["attn_pairs_replicated"])
                                 / layer_flops(s["tokens_dedup"], s["attn_pairs_dedup"]))
    return s


def _fmt_tokens(x: int) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else str(x)


def markdown_tables() -> str:
    head = "| P | R | " + " | ".join(f"N={n}" for n in NS) + " |\n|---|---|" + "---|" * len(NS) + "\n"
    out = []
    for key, title in (("token_reduction", "Token reduction N(P+R) / (P+NR): every per-token op"),
                       ("attn_flop_reduction", "Attention FLOP reduction (fwd and bwd alike)"),
                       ("layer_flop_reduction", "Whole-layer FLOP reduction, Qwen3-30B-A3B layer, fwd+bwd")):
        lines = [f"**{title}**\n", head.rstrip("\n")]
        for p in PS:
            for r in RS:
                lines.append(f"| {p} | {r} | " + " | ".join(f"{row(n, p, r)[key]:.2f}x" for n in NS) + " |")
        out.append("\n".join(lines))
    # absolute numbers for a few shapes
    lines = ["**Absolute counts per group and layer (Qwen3-30B-A3B attention: 32 heads x 128)**\n",
             "| N | P | R | tokens replicated | tokens DualKV | attn TFLOP fwd+bwd replicated | DualKV | saved |",
             "|---|---|---|---|---|---|---|---|"]
    for n, p, r in ((8, 2048, 1024), (16, 8192, 2048), (32, 32768, 1024), (64, 65536, 4096)):
        s = savings(n, p, r)
        f = lambda pairs: attention_flops(pairs, QWEN3_30B_A3B["q_heads"], QWEN3_30B_A3B["head_dim"], backward=True) / 1e12
        fr, fd = f(s["attn_pairs_replicated"]), f(s["attn_pairs_dedup"])
        lines.append(f"| {n} | {p} | {r} | {_fmt_tokens(s['tokens_replicated'])} | {_fmt_tokens(s['tokens_dedup'])} "
                     f"| {fr:.2f} | {fd:.2f} | {fr - fd:.2f} |")
    out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ps = [2 ** k for k in range(8, 17)] + [96 * 1024, 128 * 1024]
    colors = dict(zip(NS, ("#1b9e77", "#d95f02", "#7570b3", "#e7298a")))
    styles = dict(zip(RS, ("-", "--", ":")))
    panels = (("token_reduction", "tokens: N(P+R) / (P+NR)"),
              ("attn_flop_reduction", "attention FLOPs"),
              ("layer_flop_reduction", "whole layer FLOPs, fwd+bwd\n(Qwen3-30B-A3B layer)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), sharey=True)
    for ax, (key, title) in zip(axes, panels):
        for n in NS:
            for r in RS:
                ax.plot(ps, [row(n, p, r)[key] for p in ps], color=colors[n], ls=styles[r], lw=1.8)
            ax.axhline(n, color=colors[n], lw=0.6, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks([256, 1024, 4096, 16384, 65536])
        ax.set_xticklabels(["256", "1K", "4K", "16K", "64K"])
        ax.set_yticks([1, 2, 4, 8, 16, 32, 64])
        ax.set_yticklabels(["1x", "2x", "4x", "8x", "16x", "32x", "64x"])
        ax.set_ylim(0.9, 80)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("prompt length P (tokens)")
    axes[0].set_ylabel("replicated / DualKV (per layer, per group)")
    handles = [Line2D([], [], color=colors[n], lw=2, label=f"N = {n}") for n in NS]
    handles += [Line2D([], [], color="k", ls=styles[r], lw=1.5, label=f"R = {r}") for r in RS]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=10)
    fig.suptitle("DualKV savings per layer: one prompt of P tokens, N responses of R tokens "
                 "(thin lines: the limit N as P/R grows)", fontsize=12)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "savings.png"))
    ap.add_argument("--markdown", action="store_true", help="print the tables of docs/SAVINGS.md")
    args = ap.parse_args()
    plot(args.out)
    print(f"wrote {os.path.normpath(args.out)}", file=sys.stderr)
    if args.markdown:
        print(markdown_tables())


if __name__ == "__main__":
    main()
